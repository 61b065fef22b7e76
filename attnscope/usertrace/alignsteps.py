"""Each step of the reference lined up with the user's tensor that is it (align_steps): its equal, in any layout;
failing that, the tensor that stands where the step stands in the user's data flow (align.follow), or none. A step
the code fuses away or never materializes is then `unseen`, no divergence. What each step is computed from (FROM,
parents), and the step that speaks for one the code may never make (DERIVED).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnscope.usertrace import scoreaxes
from attnscope.usertrace.lined import ALIGNED, Aligned

if TYPE_CHECKING:
    import torch

    from attnscope.trace import Trace
    from attnscope.usertrace.record import Record


# A step the code may never materialize, and the step computed from it: when that one is equal, another tensor of
# the first one's shape is no divergence. enable_gqa repeats K and V inside F.scaled_dot_product_attention;
# GPT-NeoX splits a fused projection per head, so Q_feat never exists whole; LLMs-from-scratch masks before it
# scales, so the scaled scores never exist unmasked.
DERIVED = {"Q_feat": "Q_split", "K_feat": "K_split", "V_feat": "V_split", "Q_pooled": "Q_split",
           "K_pooled": "K_split", "V_pooled": "V_split", "K_rep": "scores", "V_rep": "x_raw",
           "scores": "masked_scores", "capped_scores": "masked_scores", "biased_scores": "masked_scores",
           "x_rsh2": "x_gated"}  # OpenFold gates each head's output before the merge: the merge is never ungated
# What each step is computed from, each a group of alternatives, the nearest first: after a divergence a step lines
# up only with a tensor that comes from the user's tensors for these (align.follow).
_Q = ("Q_rot", "Q_normed", "Q_split", "Q")
_K = ("K_rep", "K_cat", "K_rot", "K_normed", "K_split", "K")
_V = ("V_rep", "V_cat", "V_split", "V")
FROM: dict[str, tuple[tuple[str, ...], ...]] = {
    "Q_pooled": (("Q_feat",),), "K_pooled": (("K_feat",),), "V_pooled": (("V_feat",),),
    "Q_split": (("Q_pooled", "Q_feat"),), "K_split": (("K_pooled", "K_feat"),), "V_split": (("V_pooled", "V_feat"),),
    # over the projection, or each head after it; or the rotated heads (nGPT's: lined up after them)
    "Q_normed": (("Q_rot", "Q_feat", "Q"),), "K_normed": (("K_rot", "K_feat", "K"),),
    "Q_rot": (("Q_normed", "Q_split", "Q"),), "K_rot": (("K_normed", "K_split", "K"),),
    "K_cat": (("K_rot", "K_normed", "K_split", "K"),),
    # latent attention's rotated query part: from the code's heads (its Q_pe, a view, or a gathered copy of it)
    "Q_pe_rot": (("Q_split",),),
    "V_cat": (("V_split", "V"),), "K_rep": (_K[1:],), "V_rep": (_V[1:],), "scores": (_Q, _K),
    "capped_scores": (("scores",),), "biased_scores": (("capped_scores", "scores"),),
    "masked_scores": (("biased_scores", "capped_scores", "scores"),),
    "attention": (("masked_scores", "biased_scores", "capped_scores", "scores"),),
    "x_raw": (("attention",), _V), "out": (("attention",), _V), "x_rsh1": (("x_raw",),),
    "x_rsh2": (("x_rsh1", "x_raw"),), "x_gated": (("x_rsh2",), ("gate",)), "x": (("x_gated", "x_rsh2"),)}


def align_steps(trace: Trace, wanted: tuple[str, ...], records: list[Record],
                skips: dict[str, torch.Tensor], keys: dict[int, int] | None = None) -> list[Aligned]:
    """Each step with the user's tensor equal to it; failing that, the tensor that stands where the step stands in
    the user's data flow (align.follow), or none: a tensor of the right shape elsewhere is not the step."""
    from attnscope.usertrace import gathered
    from attnscope.usertrace import reference as ref
    from attnscope.usertrace.align import (
        ADDS_A_MASK,
        FUSED_WITH_SCORES,
        PRE_SOFTMAX,
        SCALABLE,
        adds_a_bias,
        ancestors,
        best_equal,
        best_scaled,
        best_shifted,
        closest,
        follow,
    )
    from attnscope.usertrace.flow import EXPONENTS
    from attnscope.usertrace.record import SOFTMAXES

    rows: list[Aligned] = []
    pieces = gathered.read(trace, records)  # divided attention: steps held in groups' pieces (gathered.py)
    paired: dict[str, Record] = {}  # step -> the user's tensor lined up with it
    claimed: set[int] = set()
    anchor = -1
    queries_only = query_side(records)
    for name in (n for n in ref.in_run_order(wanted, [s.name for s in trace.steps]) if n in trace):
        step, skip = trace.step(name), skips.get(name)
        turned = scoreaxes.turned(keys or {}, step.dims)  # square scores held the other way round (data flow)
        match = best_equal(records, step.tensor, skip, turned)
        if match is None and pieces:
            match = gathered.best_equal(records, step.tensor, skip, pieces)
        if match is None and name in PRE_SOFTMAX and "n_K" in step.dims:
            # a constant per query row before the softmax (MPT's ALiBi, m_h · (j − n + 1)): a convention
            match = best_shifted(records, step.tensor, step.dims.index("n_K"), skip, anchor)
        if match is None and name in SCALABLE:
            # q or k scaled early (ESM's q · d_head^-0.5 before RoPE): the step times a number, a convention
            match = best_scaled(records, step.tensor, skip, tuple(paired[p] for p in parents(name, trace)
                                                                   if p in paired), frozenset(claimed))
        if match is None and name == "gate":  # the code's own gate, taken from its run: equal, or never made whole
            rows.append(Aligned(name, step.dims, list(step.shape), None, "", None, "missing"))
            continue
        if match is None:
            after = [paired[p] for p in parents(name, trace) if p in paired]
            # a repeat of the keys (values) is never computed from the queries (a grouped einsum's output is no K_rep)
            avoid = frozenset(r.index for s, r in paired.items() if s.startswith("Q")) \
                if name in ("K_rep", "V_rep") else frozenset()
            # nor is a key's or value's step ever a tensor of the queries' side alone (CvT's q beside pooled keys)
            taken = frozenset(claimed | queries_only) if name[:1] in "KV" else frozenset(claimed)
            match = (follow(records, step.tensor, name, after, skip, taken, avoid, turned) if after
                     else closest(records, step.tensor, name, skip, anchor, taken, turned))
        if match is None:
            rows.append(Aligned(name, step.dims, list(step.shape), None, "", None, "missing"))
            continue
        if match.equal:
            anchor = match.record.index
        paired[name] = match.record
        claimed.add(match.record.index)
        status = ("equal" if match.layout.same else "permuted") if match.equal else "differs"
        said = match.layout.describe(step.dims, tuple(match.record.tensor.shape))
        if match.shifted:
            said = ((said + "; ") if said else "") + "plus a constant per row, which the softmax takes out"
        if match.factor is not None:
            said = ((said + "; ") if said else "") + (
                f"times {match.factor:.4g}: a scale applied to it, which goes on to the scores")
        rows.append(Aligned(name, step.dims, list(step.shape), match.record, said,
                            match.max_abs_diff, status, match.layout.order, match.layout.merged,
                            match.layout.split))
        if isinstance(match.layout, gathered.Gathered):  # no permutation undoes a gather
            rows[-1].order = None
    if "alibi_bias" in trace:
        _shifted_rows(rows, trace)
    _not_from_later(rows, records)
    _pooled_sources(rows, trace, records, paired)
    statuses = {row.reference: row.status for row in rows}
    held = {row.reference: row.record.index for row in rows if row.record is not None}
    # the scores with a bias added in the same op (BLOOM's alibi.baddbmm(q, kᵀ, beta=1), addmm): the biased or
    # masked scores lined up with it or with a tensor computed from it, the unbiased scores never exist
    below = {row.reference: ancestors(row.record, records) | {row.record.index} for row in rows
             if row.reference in FUSED_WITH_SCORES and row.record is not None}
    by_index = {r.index: r for r in records}
    for i, row in enumerate(rows):  # a step fused away (F.scaled_dot_product_attention) is not a divergence
        # (the code's own gate, taken from its run, is equal whatever came before: no sign of a step fused away)
        later = any(r.status in ALIGNED for r in rows[i + 1:] if r.reference != "gate")
        derived = statuses.get(DERIVED.get(row.reference, ""), "")
        if row.reference.endswith("_feat") and f"{row.reference[0]}_pooled" in trace:
            derived = ""  # what the code pools is taken from its run: nothing after it speaks for the projection
        if row.reference == "scores" and (not derived or statuses.get("biased_scores") in ALIGNED):
            # no mask, or the scores with the code's own term (a bias) held: the biased scores are made from them
            derived = statuses.get("biased_scores", "")
        # one op makes both (diffusers' baddbmm adds the mask as it computes the scores): the step never exists
        fused = row.status == "differs" and row.record is not None and row.record.func in ADDS_A_MASK \
            and (held.get(DERIVED.get(row.reference, "")) == row.record.index
                 or (row.reference == "scores" and adds_a_bias(row.record)
                     and any(row.record.index in b for b in below.values())))
        # not found, the biased scores made by such ops (one addmm per head, stacked)
        fused = fused or (row.reference == "scores" and row.status == "missing"
                          and any(adds_a_bias(by_index[n]) for n in below.get("biased_scores", ()) if n in by_index))
        # never materialized: the step computed from it is found (GQA's scores from K never repeated)
        skipped = row.status == "missing" and row.reference in ("K_rep", "V_rep") and derived in (*ALIGNED, "differs")
        # ... or the values' step is lost with it where the weights it is read with already differ (Falcon's
        # multi-query values, broadcast by the matmul: x_raw missing because the attention before it differs)
        skipped = skipped or (row.status == "missing" and row.reference == "V_rep" and derived == "missing"
                              and statuses.get("V_split") in ALIGNED
                              and statuses.get("attention") not in (*ALIGNED, ""))
        # the tensor the step computed from it holds as it is, read here with an axis split (per-head weight
        # stacks make Q_split at once: Q_feat never exists whole)
        split = row.status == "permuted" and row.split is not None and row.record is not None and derived == "equal" \
            and held.get(DERIVED.get(row.reference, "")) == row.record.index
        # online softmax in one block (lucidrains' buckets wider than the run): its exp(scores − max) has the
        # pattern's shape but is never normalized, the weighted values divided by its sum instead
        unnormalized = row.reference == "attention" and row.status == "differs" and row.record is not None \
            and not any(r.func in SOFTMAXES for r in records) \
            and any(by_index[i].func in EXPONENTS for i in ancestors(row.record, records) | {row.record.index}) \
            and not _normalized(row.record.tensor)
        # the heads' output transposed, where the code never holds it so (n_Q and n_head of one size hide a merge
        # straight from x_raw): the numbers of x_raw, found there; the merge after it says whether it is right
        transposed = row.reference == "x_rsh1" and row.status in ("differs", "missing") \
            and statuses.get("x_raw") in ALIGNED
        if (row.status == "missing" and later) or (row.status == "differs" and derived in ALIGNED) or skipped \
                or fused or split or unnormalized or transposed:
            row.status, row.record, row.max_abs_diff, row.layout = "unseen", None, None, ""
    return rows


def _pooled_sources(rows: list[Aligned], trace: Trace, records: list[Record], paired: dict[str, Record]) -> None:
    """A pooled role's `_feat` step no tensor of the code equals, compared with what the code pooled (pooled.py): the
    nearest tensor of the step's shape above the code's pooled one (a projection's output, or its part cut from a
    fused one); the values pooled from the keys' projection differ there, never unseen nor paired with a tensor the
    code never pools (an unused value chunk)."""
    import torch

    from attnscope.usertrace.align import ancestors

    for i, row in enumerate(rows):
        made = paired.get(f"{row.reference[:1]}_pooled")
        if not row.reference.endswith("_feat") or made is None or row.status not in ("missing", *ALIGNED) \
                or row.record is not None and row.record.index in ancestors(made, records):
            continue
        step = trace.step(row.reference).tensor
        found = next((records[i] for i in sorted(ancestors(made, records), reverse=True)
                      if records[i].tensor.shape == step.shape and records[i].tensor.is_floating_point()), None)
        if found is None:
            continue
        diff = float((found.tensor.double() - step.double()).abs().max())
        status = "equal" if torch.allclose(found.tensor.double(), step.double(), rtol=1e-4, atol=1e-5) else "differs"
        rows[i] = Aligned(row.reference, row.dims, row.shape, found, "", diff, status, tuple(range(step.dim())))


def _normalized(tensor: Any) -> bool:
    """Whether a pattern-shaped tensor sums to 1 along one of its last two axes: a softmax written by hand
    (`e / e.sum(..)`), over the keys or the wrong axis, which is the code's attention, never a block's unnormalized
    exp(scores − max)."""
    import torch

    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.dim() < 2:
        return False
    t = tensor.detach().double()
    return any(bool(torch.allclose(t.sum(axis), torch.ones((), dtype=t.dtype), atol=1e-4)) for axis in (-1, -2))


def query_side(records: list[Record]) -> set[int]:
    """The user's tensors on the queries' side of its data flow alone: the scores' left operand and what it is
    made from, where neither the keys (the right operand) nor the values are made from them."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.flow import operands

    found = operands(records)
    if found is None:
        return set()
    left, right, value = (records[i] for i in found[:3])
    others = ancestors(right, records) | ancestors(value, records) | {right.index, value.index}
    return (ancestors(left, records) | {left.index}) - others


def _not_from_later(rows: list[Aligned], records: list[Record]) -> None:
    """A step is never paired with a tensor computed from the tensor a later step is paired with (K_rep with the
    output of a grouped einsum that never repeats K, Q_feat with the module's return value): such a pairing is
    dropped, and the step is `missing` (then `unseen` where a later step lines up)."""
    from attnscope.usertrace.align import ADDS_A_MASK, ancestors

    for i, row in enumerate(rows):
        if row.status != "differs" or row.record is None:
            continue
        above = ancestors(row.record, records) | {row.record.index}
        if row.record.func in ADDS_A_MASK:  # baddbmm(mask, q, kᵀ): the scores and the masked scores in one op
            above.discard(row.record.index)
        if any(later.status in (*ALIGNED, "differs") and later.record is not None and later.record.index in above
               for later in rows[i + 1:]):
            row.status, row.record, row.max_abs_diff, row.layout, row.order = "missing", None, None, "", None


def _shifted_rows(rows: list[Aligned], trace: Trace) -> None:
    """BLOOM adds ALiBi as m_h · j where the reference adds −m_h · (i − j): the user's biased (and masked) scores
    are the reference's plus m_h · i, a constant per query row that the softmax takes out. Such a step is equal
    (the row says how), never a divergence."""
    import torch

    from attnscope.usertrace.align import VERY_NEGATIVE, Layout, tolerance

    for row in rows:
        if row.reference not in ("biased_scores", "masked_scores") or row.status != "differs" or row.order is None:
            continue
        assert row.record is not None
        reference = trace[row.reference].double()
        user = Layout(row.order, row.merged, row.split).undo(row.record.tensor, tuple(reference.shape)).double()
        kept = torch.isfinite(reference) & (reference > VERY_NEGATIVE)
        if not bool(torch.equal(kept, user > VERY_NEGATIVE)) or not bool(kept.any()):
            continue
        shift = torch.where(kept, user - reference, 0.0)
        count = kept.sum(-1, keepdim=True).clamp_min(1)
        spread = torch.where(kept, shift - shift.sum(-1, keepdim=True) / count, 0.0).abs().max()
        if float(spread) <= tolerance(trace[row.reference]):
            row.status, row.max_abs_diff = ("equal" if not row.layout else "permuted"), float(spread)
            row.layout = ((row.layout + "; ") if row.layout else "") + (
                "plus a constant per row (BLOOM's ALiBi, m_h · j)")


def parents(name: str, trace: Trace) -> list[str]:
    """The steps `name` is computed from, in this trace (the first of each group of alternatives it holds)."""
    return [next(s for s in group if s in trace) for group in FROM.get(name, ()) if any(s in trace for s in group)]
