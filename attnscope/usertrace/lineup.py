"""Run the reference on the user's inputs (and weights), find each of its steps among the user's tensors,
and explain the first step that has no equal.

Statuses: `equal` (same layout), `permuted` (another layout, reported), `differs` (a tensor of the
step's shape, other values), `missing` (no tensor of its shape), `unseen` (missing, but a later step is
equal: fused away, as in F.scaled_dot_product_attention). The first `differs` or `missing` is the
divergence.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from attnscope.errors import UsageError
from attnscope.usertrace import scoreaxes

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from attnscope.trace import Trace
    from attnscope.usertrace.align import Match
    from attnscope.usertrace.inputs import Inputs, ShapePlan
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Projections, Spec

ALIGNED = ("equal", "permuted")
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


@dataclass
class Aligned:
    reference: str
    dims: tuple[str, ...]
    shape: list[int]
    record: Record | None
    layout: str  # "" when the same layout, else how the user's tensor lays the step out
    max_abs_diff: float | None
    status: str  # equal | permuted | differs | missing | unseen
    order: tuple[int, ...] | None = None  # the layout: how the user's tensor permutes the step's axes
    merged: bool = False  # ... and merges neighbours of them
    split: tuple[int, int, int] | None = None  # ... after viewing one of them as two (align.Layout)


@dataclass
class Divergence:
    reference: str
    record: Record | None
    ratio: float | None
    diagnosis: str
    experiment: str | None = None  # the catalog entry whose rerun reproduced the user's tensors (experiments.py)
    evidence: str | None = None  # what that rerun reproduced, in words


@dataclass
class LineUp:
    reference: str = ""  # what the reference is, in words
    rows: list[Aligned] = field(default_factory=list)
    divergence: Divergence | None = None
    no_reference: str | None = None  # why there is none
    notes: list[str] = field(default_factory=list)
    trace: Trace | None = None  # the reference's run
    n_kv_head: int | None = None  # the reference's key/value heads (read from the weights once the code ran)
    spec: Spec | None = None  # what the reference computed: the options' spec, or a convention read from the code
    joint: bool = False  # the reference starts from the code's q, k, v joined from streams (joint.py)


def line_up(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
            spec: Spec | None = None, read_conventions: bool = True) -> LineUp:
    """The line-up under `spec`; where it diverges, under each convention the code's own tensors suggest
    (conventions.py) the first under which every step lines up, with a note saying the convention; and where the
    module adds a position bias of its own (ownbias.py, T5's), under the reference adding it too, where that lines
    up further or names the mistake."""
    from attnscope.usertrace.ownterm import output_term

    lined = _own_additions(module, shapes, inputs, records, train, spec, read_conventions)
    if read_conventions and spec is not None and spec.out_term is None and lined.divergence is not None:
        folded = _with_output_term(module, shapes, inputs, records, train, spec, lined)
        if folded is not None:
            return folded
    if read_conventions and spec is not None and spec.out_gate is None and lined.divergence is not None:
        gated = _with_output_gate(module, shapes, inputs, records, train, spec, lined)
        if gated is not None:
            return gated
    if read_conventions and spec is not None and spec.out_ops is None and lined.divergence is not None:
        opened = _with_output_ops(module, shapes, inputs, records, train, spec, lined)
        if opened is not None:
            return opened
    said = output_term(module, records, lined) if read_conventions else None
    if said is not None and lined.divergence is not None:  # Shaw's relative values: said, never blamed elsewhere
        lined.divergence.diagnosis, lined.divergence.evidence = said, None
    return lined


def _with_output_term(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
                      spec: Spec, lined: LineUp) -> LineUp | None:
    """The line-up with the reference adding the code's own term on its attention's output (outterm.py: Shaw's
    relative values), with a note, where that fits better than `lined`: clean, further, or a mistake upstream
    named by experiment (its rerun adds the term too); None otherwise."""
    from attnscope.usertrace import outterm

    term = outterm.found(module, records, lined)
    if term is None or spec.layout == "col":
        return None
    termed = replace(spec, out_term=term.tensor, out_queries=term.queries)
    again = _own_additions(module, shapes, inputs, records, train, termed, True)
    # the term's add, then ops of the code's own on the merge before its output projection (the Set Transformer's
    # `ln0` after `Q_ + A·V_`): compared up to the merge, the add the reference holds read as no op of the code's;
    # a mistake upstream is named only so, its rerun adding the term and compared where the ops begin
    opened = _with_output_ops(module, shapes, inputs, records, train, termed, again, frozenset({term.index})) \
        if again.no_reference is None else None
    again = opened if opened is not None else again
    if again.no_reference is not None or not _better(again, lined):
        return None
    again.notes.insert(0, term.note)
    return again


def _with_output_gate(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
                      spec: Spec, lined: LineUp) -> LineUp | None:
    """The line-up with the reference multiplying its merged heads by the code's own output gate (outgate.py:
    OpenFold's sigmoid(linear_g(q_x))), with a note, where that fits better than `lined`: clean, further, or a mistake
    upstream named by experiment (its rerun gates too); None otherwise."""
    from attnscope.usertrace import outgate

    gate = outgate.found(records, lined) if module is not None and spec.layout != "col" else None
    if gate is None and module is not None and spec.layout != "col":  # ops on each head's output (outops.py)
        from attnscope.usertrace.outops import head_factor

        gate = head_factor(module, records, lined)
    if gate is None:
        return None
    again = _own_additions(module, shapes, inputs, records, train,
                           replace(spec, out_gate=gate.tensor, gate_before_merge=gate.before_merge), True)
    if again.no_reference is not None or not _better(again, lined):
        return None
    again.notes.insert(0, gate.note)
    return again


def _with_output_ops(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
                     spec: Spec, lined: LineUp, held: frozenset[int] = frozenset()) -> LineUp | None:
    """The line-up compared up to the merge of the heads where the code applies ops of its own to its merged heads
    before its output projection (outops.py: BitNet's sub-norm, LeViT's activation), with a note, where that fits
    better than `lined`; None otherwise. `held`: the code's ops before the merge the reference already computes (the
    add of the code's own term on its output, outterm.py)."""
    from attnscope.usertrace import outops

    if lined.divergence is None or lined.divergence.experiment is not None:
        return None  # a mistake named by experiment (a dropout left on before the projection) stays named
    o = lined.trace is not None and module is not None and spec.layout != "col" and _output_widths(lined)
    note = outops.found(module, records, o, held) if o else None
    if note is None:
        return None
    again = _own_additions(module, shapes, inputs, records, train, replace(spec, out_ops=note), True)
    if again.no_reference is not None or not _better(again, lined):
        return None
    again.notes.insert(0, note)
    return again


def _output_widths(lined: LineUp) -> tuple[int, int] | None:
    """The reference's output projection's (in, out) widths, from its merge and its x."""
    trace = lined.trace
    if trace is None or "x" not in trace or "x_rsh2" not in trace:
        return None
    return int(trace["x_rsh2"].shape[-1]), int(trace["x"].shape[-1])


def _own_additions(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
                   spec: Spec | None, read_conventions: bool) -> LineUp:
    """line_up before the code's additions to its output are read: the module's own scale per head, and its bias
    or term on its scores."""
    first = _read(module, shapes, inputs, records, train, spec, read_conventions)
    if not read_conventions or first.divergence is None or spec is None or spec.layout == "col":
        return first
    scaled = _with_head_scale(module, shapes, inputs, records, train, spec, first)
    return scaled if scaled is not None else _own_bias_or_term(module, shapes, inputs, records, train, spec, first)


def _with_head_scale(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool, spec: Spec,
                     first: LineUp) -> LineUp | None:
    """The line-up with the code's own scale per head (headscale.py: a learned temperature), and its bias or term on
    top of it (Swin V2's position bias after its cosine scores' temperature), with a note, where that fits better
    than `first`: further, or a mistake named there; None otherwise."""
    from attnscope.usertrace import headscale

    found = headscale.found(module, records, inputs, first)
    if found is None:
        return None
    said = first.divergence.experiment if first.divergence is not None else None
    if said is not None and said != "scale.other" and found.same:
        return None  # one number in every head that a mistake of the catalog gives (a learned scale set to 1/√d_model)
    scaled = replace(spec, head_scale=found.factors)
    again = _read(module, shapes, inputs, records, train, scaled, True)
    if again.divergence is not None:
        again = _own_bias_or_term(module, shapes, inputs, records, train, scaled, again)
    if not _kept(again, first):
        return None
    again.notes.insert(0, found.note)
    return again


def _own_bias_or_term(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
                      spec: Spec, first: LineUp) -> LineUp:
    """The line-up with the module's own bias (ownbias.py) or term (ownterm.py) on its scores, where that fits
    better than `first`."""
    from attnscope.usertrace.ownbias import own_bias

    if spec.position_bias is not None or spec.alibi:
        return first
    own = own_bias(module, records, inputs)
    if own is None:
        return _with_term(module, shapes, inputs, records, train, spec, first)
    bias, said = own
    again = _read(module, shapes, inputs, records, train, replace(spec, position_bias=bias), True)
    if not _kept(again, first):
        return first
    again.notes.insert(0, said)
    return again


def _kept(again: LineUp, first: LineUp) -> bool:
    """Whether the line-up with the module's own addition to its scores (a bias, a term) fits the code better than
    `first`: further, or where its rerun names the mistake."""
    assert first.divergence is not None
    named = again.divergence is not None and again.divergence.experiment is not None \
        and first.divergence.experiment is None  # the bias's own step (biased_scores) comes before the attention
    return again.no_reference is None and (_reached(again) > _reached(first) or _better(again, first) or named)


def _with_term(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool, spec: Spec,
               first: LineUp) -> LineUp:
    """The line-up with the reference adding the code's own term on its scores (ownterm.py: Shaw's q · rel_k,
    Transformer-XL's q · R, DeBERTa's c2p), where that fits better; where the code adds such a term that trace
    cannot place, `first` with its divergence said so, in one line, rather than blamed on the scale."""
    from attnscope.usertrace.ownterm import Term, added_term, unplaced

    found = added_term(module, records, first)
    if found is None or first.divergence is None:
        return first
    if not isinstance(found, Term):
        if first.divergence.experiment is None and first.divergence.reference in SCORED:
            first.divergence.diagnosis, first.divergence.evidence = unplaced(found, records), None
        return first
    with_term = replace(spec, own_term=found.tensor, term_before_scale=found.before_scale)
    again = _read(module, shapes, inputs, records, train, with_term, True)
    spread = _spread_scale(module, shapes, inputs, records, train, with_term, again, found.products)
    if spread is not None:
        spread.notes.insert(0, found.note)
        return spread
    if not _kept(again, first):
        if first.divergence.experiment is None and first.divergence.reference in SCORED:
            first.divergence.diagnosis, first.divergence.evidence = unplaced(found.record, records, True), None
        return first
    again.notes.insert(0, found.note)
    return again


def _spread_scale(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool, spec: Spec,
                  again: LineUp, products: int) -> LineUp | None:
    """DeBERTa's scale: 1/√((1 + m) · d_head) where the code adds m ≥ 2 products of its queries or keys with a table
    (c2p and p2c: its scale_factor, 1 + len(pos_att_type)), read as the module's own where the line-up under it is
    clean or goes further, with a note; None otherwise."""
    from attnscope.usertrace.ownterm import d_head_of

    d_head = d_head_of(again.trace) if again.trace is not None else None
    if products < 2 or spec.scale is not None or again.divergence is None or d_head is None:
        return None
    factor = 1 + products
    lined = _read(module, shapes, inputs, records, train, replace(spec, scale=(factor * d_head) ** -0.5), True)
    if lined.no_reference is not None or not _better(lined, again):
        return None  # neither clean nor further, nor a mistake elsewhere named only under it (values from the keys)
    lined.notes.insert(0, f"scale 1/√({factor}·d_head) = {(factor * d_head) ** -0.5:.6g}: your scores sum q · kᵀ and "
                       f"{products} relative terms, each divided by √({factor}·d_head) (DeBERTa's scale_factor, 1 + "
                       "the number of relative terms); the reference scales so too, a convention (--scale gives "
                       "another)")
    return lined


SCORED = ("scores", "capped_scores", "biased_scores", "masked_scores", "attention")


def _read(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
          spec: Spec | None = None, read_conventions: bool = True) -> LineUp:
    """line_up without the module's own bias."""
    from attnscope.usertrace import clips, conventions
    from attnscope.usertrace.declared import own_scaling

    said_base = None
    declared = conventions.own_base(module, spec.built_with) if spec is not None and spec.rope_base is not None \
        else None
    default = spec is not None and spec.rope_base == conventions.DEFAULT_BASE and not spec.base_asked
    if spec is not None and declared is not None and default and declared != spec.rope_base \
            and not takes_tables(module):
        # the module's own rope_theta, where --rope-base said none
        spec = replace(spec, rope_base=declared, base_from_module=True)
    if spec is not None and spec.base_from_module and spec.rope_base is not None:  # read here or by the caller
        declared = spec.rope_base
        said_base = (f"RoPE base {declared:g}, read from your module (its rope_theta or base, or its config's); "
                     "--rope-base overrides it")
    own_notes: list[str] = []
    if spec is not None and module is not None:  # the softcap and scale the module's config says
        from attnscope.usertrace.declared import DECLARED_CLIP, with_declared

        spec, own_notes = with_declared(module, spec)
        clipped = clips.read(records) if spec.clip_qkv is None else None
        if clipped is not None:  # a clamp of the projections' output no config says (DBRX's qkv.clamp)
            spec = replace(spec, clip_qkv=clipped[0])
            own_notes.append(clips.note(*clipped))
        spec, where = clips.placed(records, spec)  # after the qk-norm (HF OLMoE's clamp), not the projection
        if where:  # said in place of the config's note, which puts the clip after the projection
            own_notes = [n for n in own_notes if not n.startswith(DECLARED_CLIP)] + [where]
    first = _line_up(module, shapes, inputs, records, train, spec)
    if said_base is not None:
        first.notes.insert(0, said_base)
    first.notes[:0] = own_notes
    if not read_conventions or first.divergence is None or first.trace is None or spec is None:
        return first
    if spec.causal == "upper-left" and not spec.align_asked and not spec.cache \
            and inputs.sizes.get("n_Q") != inputs.sizes.get("n_K"):
        # keys and queries of different lengths: a causal mask aligned to the last key is another convention
        lower = _line_up(module, shapes, inputs, records, train, replace(spec, causal="lower-right"))
        if lower.no_reference is None and _better(lower, first):
            row = next((r for r in lower.rows if r.reference == "masked_scores" and r.record is not None), None)
            where = f" (line {row.record.line})" if row is not None and row.record is not None else ""
            lower.notes.insert(0, f"causal mask as your code computes it{where}: aligned lower-right, query i sees "
                                  "keys 0 to n_K − n_Q + i, so the last query sees every key (flash-attn's and "
                                  "x-transformers' alignment, F.scaled_dot_product_attention's is_causal being "
                                  "upper-left). " + ("A convention, not a mistake: the reference was masked so; "
                                                     if lower.divergence is None else
                                                     "Read from your code, and the reference masked so: the "
                                                     "divergence below is another matter; ")
                                  + "--causal lower-right says it")
            if said_base is not None:
                lower.notes.insert(0, said_base)
            lower.notes[:0] = own_notes
            return lower
    if spec.causal == "upper-left" and spec.align_asked and not spec.cache \
            and inputs.sizes.get("n_Q") != inputs.sizes.get("n_K"):
        # --causal upper-left typed: the code's lower-right alignment is then a bug, said as what the code does
        lower = _line_up(module, shapes, inputs, records, train, replace(spec, causal="lower-right"))
        if lower.no_reference is None and _better(lower, first):
            first.notes.insert(0, "your code's causal mask is aligned lower-right (query i sees keys 0 to n_K − n_Q + "
                                  "i: the reference run so lines up further) where --causal upper-left asks query i "
                                  "to see keys 0 to i; as asked, that is the divergence below (--causal lower-right "
                                  "if the alignment is meant)")
    best, best_said, reached = first, None, _reached(first)
    base_free = default and declared is None
    scaled = own_scaling(module, spec.built_with)
    for other, said in conventions.readings(spec, first.trace, first.rows, records, base_free, scaled):
        again = _line_up(module, shapes, inputs, records, train, other)
        if again.divergence is not None and spec.cache:  # RoPE read so, and a cache of keys before RoPE
            again = _cache_read(module, shapes, inputs, records, train, again)
        if _undoes(again, other, spec):
            continue  # read as the code's convention, then called a mistake by the rerun that undoes it: no reading
        if again.no_reference is None and (_reached(again) > reached and _sees(again, best)
                                            or _reached(again) == reached and _better(again, best)):
            # the code's tensors say it, further on, or where a rerun then names the mistake at the same step
            best, best_said, reached = again, said, _reached(again)
            if again.divergence is None:
                break
    if best.divergence is not None and spec.cache:
        best = _cache_read(module, shapes, inputs, records, train, best)
    if said_base is not None and best is not first:
        best.notes.insert(0, said_base)
    if best is not first:
        best.notes[:0] = own_notes
    if best_said is not None:  # a convention read from the code: said, whether or not a later step diverges
        line = next((row.record.line for row in best.rows
                     if row.reference in ("Q_rot", "K_rot") and row.record is not None), None)
        best.notes.insert(0, conventions.note(best_said, line, clean=best.divergence is None))
    return best


def _cache_read(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
                best: LineUp) -> LineUp:
    """The line-up with the code's cache read as keys before RoPE (cachekeys.py: the code rotates the joined keys
    at their positions), where that lines up further or names the mistake; `best` otherwise."""
    from attnscope.usertrace import cachekeys

    spec = best.spec
    held = cachekeys.unrotated(inputs, spec) if spec is not None else None
    if held is None or spec is None:
        return best
    again = _line_up(module, shapes, held, records, train, replace(spec, cache_before_rope=True))
    if again.no_reference is not None or not (_reached(again) > _reached(best) or _better(again, best)):
        return best
    line = next((row.record.line for row in again.rows if row.reference == "K_cat" and row.record is not None), None)
    again.notes.insert(0, cachekeys.note(line, again.divergence is None))
    return again


def _undoes(lined: LineUp, reading: Spec, spec: Spec) -> bool:
    """Whether the divergence under a reading is named by the experiment that changes back what the reading changed
    (the pairing read as interleaved, then `rope.pairing` by experiment): the reading contradicts itself."""
    experiment = lined.divergence.experiment if lined.divergence is not None else None
    changed = {"rope.pairing": reading.rope_pairing != spec.rope_pairing,
               "rope.base": reading.rope_base != spec.rope_base,
               "rope.fraction": reading.rope_fraction != spec.rope_fraction,
               "rope.positions": reading.rope_start != spec.rope_start}
    return bool(experiment is not None and changed.get(experiment))


def better_fit(other: LineUp, first: LineUp) -> bool:
    """Whether `other` fits the code better than `first` (_better): RoPE's tables of another form (runs/trace.py)."""
    return _better(other, first)


def _better(other: LineUp, first: LineUp) -> bool:
    """Whether a line-up under another reading fits the code better than `first`: no divergence, a later one, or
    the same one with a cause its rerun reproduced where `first` has none."""
    if other.divergence is None:
        return True
    if first.divergence is None or _reached(other) != _reached(first):
        return _reached(other) > _reached(first)
    return _named(other.divergence.experiment) > _named(first.divergence.experiment)


def _named(experiment: str | None) -> int:
    """How well a divergence is explained: no entry, two mistakes at once (pairs.py: "a+b"), one entry."""
    return 0 if experiment is None else 1 if "+" in experiment else 2


def takes_tables(module: Any) -> bool:
    """Whether the module's forward takes RoPE's tables (trace makes them with the reference's base)."""
    import inspect

    from attnscope.usertrace.load import TABLE_NAMES

    try:
        return any(name in TABLE_NAMES for name in inspect.signature(module.forward).parameters)
    except (TypeError, ValueError, AttributeError):
        return False


def _sees(other: LineUp, best: LineUp) -> bool:
    """Whether `other`, diverging later, lines up the step where `best` diverged, or either leaves it unnamed: a
    reading that merely loses sight of a step whose mistake `best` named by experiment (heads split the wrong way,
    unseen under another pairing) goes no further."""
    named = best.divergence is not None and best.divergence.experiment is not None
    if not named or other.divergence is None or other.divergence.experiment is not None:
        return True
    assert best.divergence is not None
    return any(row.reference == best.divergence.reference and row.status in ("equal", "permuted")
               for row in other.rows)


def _reached(lined: LineUp) -> int:
    """How far the line-up got: the number of steps before its divergence (all of them where there is none)."""
    if lined.divergence is None:
        return len(lined.rows) + 1
    return next((i for i, row in enumerate(lined.rows) if row.reference == lined.divergence.reference), 0)


def _line_up(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
             spec: Spec | None = None) -> LineUp:
    from attnscope.usertrace import reference as ref
    from attnscope.usertrace.align import candidates, compare
    from attnscope.usertrace.diagnose import diagnose
    from attnscope.usertrace.diagnosis import Context
    from attnscope.usertrace.rotary import after_repeat

    spec = spec or ref.Spec()
    out = LineUp()
    try:
        built = _references(module, shapes, inputs, records, spec)
    except UsageError as exc:
        out.no_reference = str(exc)
        return out
    trace, wanted, reference_module, projections, out.reference, out.rows, skips, keys = built
    out.trace, out.spec = trace, spec
    out.n_kv_head = getattr(reference_module, "n_kv_head", None)
    out.joint = projections is not None and projections.joint
    if out.joint and module is not None:  # a stream's own q, k or v wrong, before the join the reference reads
        from attnscope.usertrace import joint, jointstreams

        joined = joint.find(records, dict(module.named_parameters()))
        n_head = int(reference_module.n_head)
        fault = joint.split_fault(records, joined, n_head) or jointstreams.fault(records, joined, n_head) \
            if joined is not None else None
        if fault is not None:
            return _split_fault(out, fault)
    if projections is not None and projections.note:
        out.notes.append(projections.note)
    if train:
        from attnscope.usertrace.dropouts import with_users_dropout

        dropped = with_users_dropout(trace, records, reference_module)
        if dropped is not None:
            applied, note = dropped
            out.notes.append(note)
            if applied is not None:
                trace = out.trace = applied
                out.rows = _align(trace, wanted, records, skips, keys)
    if skips:
        out.notes.append("some queries may attend to no key: attnscope gives them zeros, hand-written code often "
                         "a uniform average or NaN; those rows are left out of the comparison")
    out.notes += _kernel_notes(records)
    kind = "module" if module is not None else "function"
    ctx = Context(kind, inputs.sizes, trace, records, reference_allowed(trace),
                  train, projections, skips, spec, layout=inputs.layout, keys=keys, inputs=inputs)
    for row in out.rows:  # rotated keys never made, the repeated ones rotated instead: same numbers, yet a mistake
        if row.reference == "K_rot" and row.status == "unseen" and after_repeat("K_rot", ctx) is not None:
            row.status = "missing"
    first = next((row for row in out.rows if row.status in ("differs", "missing")), None)
    if first is None:
        # every step has its equal: what the code returns must hold the last of them too (a merge after it, a
        # reshape without the permute back, is no step of the reference's)
        first, goes_on = _return_differs(out.rows, trace, records, skips, set(inputs.tensors), train) \
            if spec is None or spec.out_ops is None else (None, None)  # compared up to the merge (outops.py)
        if goes_on is not None:
            out.notes.append(goes_on)
        if first is None:
            return out
        ctx.returned = first.record
    first = _split_in_flow(first, out.rows, trace, records, skips)
    first = _scaled_again(first, out.rows, trace, records, skips)
    tensor, skip = trace[first.reference], skips.get(first.reference)
    used = frozenset(row.record.index for row in out.rows if row.status in ALIGNED and row.record is not None)
    turned = scoreaxes.turned(keys, trace.step(first.reference).dims)
    ranked = _before_later(candidates(records, tensor, first.reference, skip, _anchor(out.rows), used, turned),
                           out.rows[out.rows.index(first) + 1:], records)
    if first.reference[:1] in "KV":  # a key's or value's step is never shown at a tensor of the queries' alone
        queries_only = _queries_only(records)
        ranked = [m for m in ranked if m.record.index not in queries_only]
    if first.record is not None:  # the tensor where the step stands in your data flow (_align) is the likeliest
        chosen = first.record.index
        ranked.sort(key=lambda m: m.record.index != chosen)
    found = diagnose(first.reference, ctx, ranked)
    later = next((row for row in out.rows if row.reference == found.step), None) if found.step else None
    if later is not None:  # the code never holds the first step (it masks before it scales): the later one diverges
        first.status, first.record, first.max_abs_diff, first.layout = "unseen", None, None, ""
        first.order, first.merged, first.split = None, False, None
        first = later
        first.status = "differs"
        tensor, skip = trace[first.reference], skips.get(first.reference)
    out.divergence = Divergence(first.reference, found.record or first.record, found.ratio, found.text,
                                found.experiment, found.evidence)
    shown = compare(found.record, tensor, skip)[:1] if found.record is not None else []
    if found.record is not None and shown:  # the row shows the tensor the diagnosis speaks of
        step = trace.step(first.reference)
        first.record, first.max_abs_diff = found.record, shown[0].max_abs_diff
        first.layout = shown[0].layout.describe(step.dims, tuple(found.record.tensor.shape))
        first.order, first.merged, first.split = shown[0].layout.order, shown[0].layout.merged, shown[0].layout.split
    return out


def _references(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], spec: Spec) -> tuple[
        Trace, tuple[str, ...], Any, Projections | None, str, list[Aligned], dict[str, torch.Tensor], dict[int, int]]:
    """The reference run on the inputs; for a module, under each reading of its projections (a fused one can
    be split several ways), the one under which most steps find their equal. Last, which axis of each of the
    code's scores holds the keys, read from its data flow under that reading (scoreaxes.key_axes)."""
    from attnscope.usertrace import headscale, outgate, outterm
    from attnscope.usertrace import reference as ref

    Q, K, V = inputs.qkv()
    if module is None:
        keys = scoreaxes.key_axes(records, *given_roles(inputs))
        col = spec.layout == "col"
        trace = (ref.run_columns if col else ref.run_sdpa)(Q, K, V, inputs.mask, spec)
        skips = {} if col else _skips(trace)  # the column form's own zero columns are compared as they are
        what = f"attnscope sdpa{' --layout col' if col else ''}: out = " + (
            "V softmax(Kᵀ Q / √d_K), softmax over keys (dim -2)" if col else "softmax(Q Kᵀ / √d_K) V")
        what += f"; {spec.describe()}" if spec.describe() else ""
        return trace, ref.SDPA_STEPS, None, None, what, _align(trace, ref.SDPA_STEPS, records, skips, keys), skips, \
            keys
    from attnscope.usertrace import latent, valuegain, widerows

    refused = latent.refusal(records, type(module).__name__)  # MLA: keys and values expanded from one latent
    if refused is not None:
        found = _latent_reference(module, shapes, inputs, records, spec)
        if found is None:
            raise refused
        return found
    if spec.layout != "col":  # streams joined along the tokens (Flux, SD3): the reference starts where they meet
        from attnscope.usertrace import joint

        joined = joint.find(records, dict(module.named_parameters()))
        made = _joint_reference(module, shapes, inputs, records, spec, joined) if joined is not None else None
        if made is not None:
            return made
    if shapes.n_head is None:
        raise UsageError(shapes.why_no_heads or "cannot tell how many heads the module has; pass --heads")
    best: tuple[Any, ...] | None = None
    error: UsageError | None = None
    mask, col = inputs.mask, spec.layout == "col"
    from attnscope.usertrace import columns

    if col:  # the column form: the row form's reference on the inputs transposed, its steps transposed back
        Q, K, V, mask = columns.rows(Q, K, V, mask)  # [.., d, n] -> [.., n, d]; a mask [.., n_K, n_Q] transposed
    Q, K, V = columns.batched(Q, K, V)  # one sequence [n, d] (picoGPT's) as a batch of one, its axis merged away
    gain = valuegain.find(records, dict(module.named_parameters()))  # modded-nanogpt's lambdas[0] * v
    for projections in ref.find_projections(module, records, shapes.n_head, shapes.fixed.get("d_head"),
                                            {name: role for name, role in inputs.roles.items() if role not in
                                             inputs.own}):
        if gain is not None and projections.matched_by != "identity":
            projections = valuegain.apply(projections, gain)
        if projections.matched_by != "identity":  # a projection the role reads some rows of (Qwen3-Next's q_proj)
            projections = widerows.narrowed(projections, records)
        if spec.out_ops is not None and not col and "o" in projections.linears:  # ops on the merge (outops.py)
            from attnscope.usertrace.outops import merged

            projections = merged(projections, spec.out_ops)
        try:
            try:
                reference = ref.build_mha(projections, shapes.n_head, spec, module, records)
            except UsageError:  # an output projection reading the merge beside an MLP's features (a parallel block)
                wider = ref.merge_only(projections)
                if wider is None:
                    raise
                projections, reference = wider, ref.build_mha(wider, shapes.n_head, spec, module, records)
            trace = ref.run_mha(reference, Q, K, V, mask, inputs.cache, spec.added(cast(int, reference.d_head)))
            if spec.pooled is not None and not col:  # the code's own pooled q, k or v (pooled.py)
                from attnscope.usertrace import pooledref

                trace, reference = pooledref.combined(trace, projections, shapes.n_head, spec, module, records,
                                                      (Q, K, V))
            if spec.head_scale is not None and not col:  # the code's own scale per head (headscale.py)
                trace = headscale.scaled(trace, spec.head_scale, reference,
                                         spec.scale if spec.scale is not None else cast(int, reference.d_head) ** -0.5)
            if spec.out_term is not None and not col:  # the code's own term on its output (outterm.py)
                trace = outterm.folded(trace, spec.out_term, reference)
            if spec.out_gate is not None and not col:  # the code's own gate on its output (outgate.py)
                trace = outgate.gated(trace, spec.out_gate, reference)
        except UsageError as exc:
            error = error or exc
            continue
        skips = _skips(trace)
        if col:  # the steps and the rows of queries that see no key, in the column form
            trace, skips = columns.columns(trace), columns.columns_of(skips)
        # code handed q, k, v already projected (identity.py): its inputs are the projections, no step of its own
        wanted = tuple(s for s in ref.MHA_STEPS if not s.endswith("_feat")) if projections.matched_by == "identity" \
            else ref.MHA_STEPS
        best = _best_reading(best, records, inputs, (trace, reference, projections, skips, wanted))
    if best is None:
        raise error or UsageError(f"no reference for {type(module).__name__}")
    _, trace, reference, projections, rows, skips, wanted, keys = best
    if projections.merge_only and not col:  # the merge lined up where the code makes it, its layout checked
        from attnscope.usertrace.joint import merge_row

        merge_row(rows, trace, records)
    variants = f", {spec.describe()}" if spec.describe() else ""
    kv = f", n_kv_head={reference.n_kv_head}" if reference.n_kv_head != reference.n_head else ""
    d_v = f", d_V={reference.d_v}" if reference.d_v != reference.d_head else ""  # values of their own width
    what = (f"attnscope MultiHeadAttention (d_feat={reference.d_feat}, n_head={shapes.n_head}{kv}, d_head="
            f"{reference.d_head}{d_v}, scores / √d_head{variants}) holding your weights: {projections.describe()}")
    if projections.matched_by == "identity":
        from attnscope.usertrace import identity

        what = identity.describe(reference.d_feat, shapes.n_head, reference.d_head, variants)
    what += "; in the column form, your inputs transposed in and its steps transposed out" if col else ""
    return trace, wanted, reference, projections, what, rows, skips, keys


def _best_reading(best: tuple[Any, ...] | None, records: list[Record], inputs: Inputs, run: tuple[Any, ...],
                  evidence: Callable[[list[Aligned]], int] | None = None) -> tuple[Any, ...]:
    """Of the best reading so far and `run` (trace, reference, projections, skips, wanted), the one under which more
    steps find their equal, as (aligned, trace, reference, projections, rows, skips, wanted, keys); `evidence`
    corrects the count from the rows (latentref.evidence: steps every form's code holds say nothing of the form)."""
    trace, reference, projections, skips, wanted = run
    keys = scoreaxes.key_axes(records, *projected_roles(projections, inputs))
    rows = _align(trace, wanted, records, skips, keys)
    aligned = sum(row.status in ALIGNED for row in rows) + (evidence(rows) if evidence is not None else 0)
    if best is None or aligned > best[0]:
        return (aligned, trace, reference, projections, rows, skips, wanted, keys)
    return best


def _split_fault(out: LineUp, fault: Any) -> LineUp:
    """The line-up of joint attention where a stream's own q, k or v is wrong before the join (joint.split_fault: its
    heads split without the transpose; jointstreams.fault): the divergence at that role's split, at the code's
    tensor, named by its experiment."""
    from attnscope.usertrace.align import difference

    step = f"{fault.role}_split"
    row = next((r for r in out.rows if r.reference == step), None)
    if row is not None:
        row.record, row.status, row.layout, row.order, row.merged, row.split = fault.split, "differs", "", None, \
            False, None
        same = out.trace is not None and tuple(out.trace[step].shape) == tuple(fault.split.tensor.shape)
        row.max_abs_diff = difference(fault.split.tensor, out.trace[step]) if same and out.trace is not None else None
        row.max_abs_diff = getattr(fault, "max_abs_diff", None) or row.max_abs_diff  # the stream's own, where said
    diagnosis, evidence = fault.words()
    out.divergence = Divergence(step, fault.split, None, diagnosis, fault.experiment, evidence)
    return out


def _joint_reference(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], spec: Spec,
                     joined: Any) -> tuple[Trace, tuple[str, ...], Any, Projections | None, str, list[Aligned],
                                       dict[str, torch.Tensor], dict[int, int]] | None:
    """`_references` for joint attention (usertrace/joint.py): attnscope's MultiHeadAttention with identity
    projections on the code's joined q, k and v, compared up to the merge of the heads; the qk-norm the options ask
    for read as the code's own before the join (each stream's norms), else as the reference's over the joined q and
    k, whichever lines up further. None where the joined tensors' layout is not read."""
    import torch

    from attnscope.usertrace import fused, joint, jointstreams
    from attnscope.usertrace import reference as ref

    n_head = joint.heads(joined, shapes.n_head)
    merged = joined.merged(n_head) if n_head else None
    if merged is None or n_head is None:
        return None
    Q, K, V = merged
    parts = {role: (f"(identity {role})", fused.Part(f"(identity {role})", torch.eye(
        int(t.shape[-1]), dtype=t.dtype, device=t.device), None)) for role, t in zip("qkvo", (Q, K, V, Q), strict=True)}
    note = joined.note(jointstreams.said(records, joined, n_head))
    projections = ref.Projections(parts, "identity", note, joint=True)
    mask = inputs.mask if inputs.mask is not None and tuple(inputs.mask.shape[-2:]) == (joined.n, joined.n) else None
    wanted = tuple(s for s in ref.MHA_STEPS if not s.endswith("_feat"))
    best: tuple[Any, ...] | None = None
    for reading in (replace(spec, qk_norm=None), *((spec,) if spec.qk_norm else ())):
        try:
            reference = ref.build_mha(projections, n_head, reading, module if reading.qk_norm else None)
            trace = ref.run_mha(reference, Q, K, V, mask, None, reading.added(cast(int, reference.d_head)))
        except UsageError:
            continue
        best = _best_reading(best, records, inputs, (trace, reference, projections, _skips(trace), wanted))
    if best is None:
        return None
    _, trace, reference, projections, rows, skips, wanted, keys = best
    joint.merge_row(rows, trace, records)
    rest = replace(spec, qk_norm=None).describe() if reference.spec.norm is None else spec.describe()
    own = "; qk-norm: each stream's own, before the join" if spec.qk_norm and reference.spec.norm is None else ""
    kv = f", n_kv_head={reference.n_kv_head}" if reference.n_kv_head != n_head else ""
    what = (f"attnscope MultiHeadAttention (n_head={n_head}{kv}, d_head={reference.d_head}, scores / √d_head"
            f"{', ' + rest if rest else ''}) with identity projections on your joined q, k and v ({joined.n} tokens), "
            f"compared up to the merge of the heads{own}")
    return trace, wanted, reference, projections, what, rows, skips, keys


def _latent_reference(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], spec: Spec) -> tuple[
        Trace, tuple[str, ...], Any, Projections | None, str, list[Aligned], dict[str, torch.Tensor], dict[int, int]
        ] | None:
    """`_references` for multi-head latent attention (usertrace/latentref.py): attnscope's LatentAttention holding
    the module's weights, under the rotary form that lines up best; None where none can be built."""
    from attnscope.usertrace import latentcache, latentref

    if shapes.n_head is None or (inputs.cache is not None and inputs.latent_cache is None) or spec.layout == "col":
        return None
    Q, _, _ = inputs.qkv()
    held = inputs.latent_cache  # a decode step's: the latents the code's expanded cache was made from
    best: tuple[Any, ...] | None = None
    for reference, projections in latentref.candidates(module, records, shapes.n_head, spec):
        try:
            trace = latentref.run(reference, Q, inputs.mask, held)
        except UsageError:
            continue
        if held is not None:
            trace = latentcache.decoded(trace, int(held[0].shape[-2]))
        wanted = latentref.wanted(reference, trace)
        best = _best_reading(best, records, inputs, (trace, reference, projections, _skips(trace), wanted),
                             partial(latentref.evidence, reference, trace, records))
    if best is None:
        return None
    _, trace, reference, projections, rows, skips, wanted, keys = best
    L = reference.latent
    rest = replace(spec, rope_base=None).describe()  # the rotary form is said with the layers' reading
    variants = f", {rest}" if rest else ""
    what = (f"attnscope LatentAttention (multi-head latent attention: d_feat={reference.d_feat}, n_head="
            f"{reference.n_head}, kv_lora_rank={L.kv_lora_rank}, q_lora_rank={L.q_lora_rank}, d_nope="
            f"{L.qk_nope_head_dim}, d_rope={L.qk_rope_head_dim}, d_V={L.v_head_dim}, scores / √d_K{variants}) "
            f"holding your weights: {projections.describe()}")
    return trace, wanted, reference, projections, what, rows, skips, keys


def given_roles(inputs: Inputs) -> tuple[set[str], set[str]]:
    """The labels of the inputs the queries and the keys are (a function's Q and K; none where one input is
    both)."""
    query = {name for name, role in inputs.roles.items() if role == "Q"}
    key = {name for name, role in inputs.roles.items() if role == "K"}
    return (query, key) if key else (set(), set())


def projected_roles(projections: Projections, inputs: Inputs) -> tuple[set[str], set[str]]:
    """What a module's queries and keys are computed from: its q and k projections' names under this reading (and
    the inputs they read, where query and key are given apart)."""
    query, key = given_roles(inputs)
    for role, names in (("q", query), ("k", key)):
        if role in projections.linears:
            names.add(projections.linears[role][0])
    return query, key


def reference_allowed(trace: Trace) -> torch.Tensor | None:
    """What the reference lets each query see (True = may attend), read off its masked scores."""
    import torch

    if "masked_scores" not in trace:
        return None
    return ~torch.isneginf(trace["masked_scores"])


def _kernel_notes(records: list[Record]) -> list[str]:
    """Say, once per kernel call, which steps were recomputed because it does not materialize them."""
    notes, seen = [], set()
    for record in records:
        kernel = record.details.get("recomputed")
        if kernel and (record.line, kernel) not in seen:
            seen.add((record.line, kernel))
            steps = [r.names[0].strip("()") for r in records
                     if r.details.get("recomputed") == kernel and r.line == record.line]
            notes.append(f"line {record.line}: {kernel} computes {', '.join(steps)} inside its kernel without "
                         "materializing them; they are recomputed from its arguments to line up, named in "
                         "parentheses, (scores), and its output is compared as it is")
    return notes


def _anchor(rows: list[Aligned]) -> int:
    """The user's tensor that matched the last step before the divergence (-1 when none did)."""
    anchor = -1
    for row in rows:
        if row.status not in ALIGNED:
            break
        if row.record is not None:
            anchor = row.record.index
    return anchor


def _align(trace: Trace, wanted: tuple[str, ...], records: list[Record],
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
    queries_only = _queries_only(records)
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
            match = best_scaled(records, step.tensor, skip, tuple(paired[p] for p in _parents(name, trace)
                                                                   if p in paired), frozenset(claimed))
        if match is None and name == "gate":  # the code's own gate, taken from its run: equal, or never made whole
            rows.append(Aligned(name, step.dims, list(step.shape), None, "", None, "missing"))
            continue
        if match is None:
            after = [paired[p] for p in _parents(name, trace) if p in paired]
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


def _queries_only(records: list[Record]) -> set[int]:
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


FINAL = ("x", "x_rsh2", "out")  # the steps a call's result holds: the module's output (its merge without W_o), sdpa's


def _return_differs(rows: list[Aligned], trace: Trace, records: list[Record], skips: dict[str, torch.Tensor],
                    given: set[str], train: bool) -> tuple[Aligned | None, str | None]:
    """The last step, lined up with what the code returned, where the line-up found that step inside the code (its
    `attn @ v`) but the tensor the call hands back holds it in no layout (`out.reshape(B, M, H, K)` with the permute
    back forgotten): the row, now at the returned tensor and `differs`. None where a returned tensor holds it, or
    where nothing returned has its size (the code returns something else: its weights alone, a cache); and where the
    code goes on from the last step as a block does, joining another tensor to it (a residual of its input `given`,
    then a norm) or dropping out in training mode, None and a note saying so. Ops on the last step alone (a scale,
    the projection twice) are no block: the return is then the divergence."""
    from attnscope.usertrace.align import REARRANGING, ancestors, compare, tolerance

    final = next((row for row in reversed(rows) if row.reference in FINAL and row.status in ALIGNED
                  and row.record is not None), None)
    if final is None or final.record is None:
        return None, None
    step = trace[final.reference]
    returned = sorted((r for r in records if "returned" in r.details and r.tensor.is_floating_point()
                       and r.tensor.numel() == step.numel()), key=lambda r: r.details["returned"])
    if not returned:
        return None, None
    skip = skips.get(final.reference)
    for record in returned:
        tol = max(tolerance(step), tolerance(step.to(record.tensor.dtype)))  # a result cast back to half precision
        if record.index == final.record.index or any(m.equal for m in compare(record, step, skip, tol=tol)):
            return None, None
    record = returned[0]
    held = final.record.index
    above = ancestors(record, records)
    if held in above:
        between = [r for r in records if held < r.index <= record.index and (r.index in above or r is record)
                   and held in ancestors(r, records)]
        on_path = {r.index for r in between} | {held}
        joined = next((r for r in between if r.func not in REARRANGING and (
            _reads_input(r, given) or any(p not in on_path for p in r.parents)
            or (train and r.func == "dropout"))), None)
        if joined is not None:  # a residual and a norm, a gate: a block goes on from the attention's output
            return None, (f"your code goes on after {final.reference}: your {record.label} (line {record.line}), "
                          f"what it returns, is computed from your {final.record.label} (line {final.record.line}) "
                          f"and more (line {joined.line}: {joined.details.get('op', joined.call)}), as a block's "
                          f"residual, norm or dropout; it is compared up to {final.reference}")
    matches = compare(record, step, skip)
    final.record, final.status = record, "differs"
    final.max_abs_diff = matches[0].max_abs_diff if matches else None
    final.layout = matches[0].layout.describe(trace.step(final.reference).dims, tuple(record.tensor.shape)) \
        if matches else ""
    final.order, final.merged, final.split = (matches[0].layout.order, matches[0].layout.merged,
                                              matches[0].layout.split) if matches else (None, False, None)
    return final, None


def _reads_input(record: Record, given: set[str]) -> bool:
    """Whether one of the record's arguments is an input of the call, by its label (`out + hidden_states`)."""
    return any(kind == "text" and value in given for kind, value in record.args) or any(
        kind == "kw" and value[1][0] == "text" and value[1][1] in given for kind, value in record.args)


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


def _before_later(ranked: list[Match], later: list[Aligned], records: list[Record]) -> list[Match]:
    """The tensors a diverging step may be shown at: none computed from a tensor a later step is paired with
    (Q_feat never at the module's return value, computed from the scores and the output)."""
    from attnscope.usertrace.align import ancestors

    held = {row.record.index for row in later if row.record is not None and row.status in (*ALIGNED, "differs")}
    if not held:
        return ranked
    return [m for m in ranked if not (ancestors(m.record, records) & held)]


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


def _split_in_flow(first: Aligned, rows: list[Aligned], trace: Trace, records: list[Record],
                   skips: dict[str, torch.Tensor]) -> Aligned:
    """The step that really diverges, found through the user's data flow: a step `first` is computed from lines up
    with a tensor of the user's (Q_split with the projection's output, viewed), but on the way to the user's
    `first` that tensor is rearranged into one that is not the step (a view without the transpose). That step, at
    that tensor, is the divergence; else `first` is."""
    from attnscope.usertrace.align import rearranged_wrongly

    if first.record is None:
        return first
    by_step = {row.reference: row for row in rows}
    for parent in _parents(first.reference, trace):
        row = by_step.get(parent)
        if row is None or row.status not in ALIGNED or row.record is None:
            continue
        step = trace.step(parent)
        found = rearranged_wrongly(records, row.record, first.record, step.tensor, skips.get(parent))
        if found is not None:
            return _differs_at(row, found, step.dims)
    return first


def _scaled_again(first: Aligned, rows: list[Aligned], trace: Trace, records: list[Record],
                  skips: dict[str, torch.Tensor]) -> Aligned:
    """The scores step, where a later step diverges because the user's scores, once equal to the reference's, were
    multiplied or divided again on the way to the softmax (the scale applied twice): the scores, at the tensor
    that scaling made, are the divergence; else `first` is."""
    from attnscope.usertrace.align import rescaled

    row = next((r for r in rows if r.reference == "scores"), None)
    if row is None or row is first or row.status not in ALIGNED or row.record is None \
            or rows.index(first) < rows.index(row):
        return first
    found = rescaled(records, row.record, trace["scores"], skips.get("scores"))
    if found is None:
        return first
    return _differs_at(row, found, trace.step("scores").dims)


def _differs_at(row: Aligned, found: Match, dims: tuple[str, ...]) -> Aligned:
    """`row`, lined up now with `found`'s tensor, where the step differs."""
    row.record, row.max_abs_diff, row.status = found.record, found.max_abs_diff, "differs"
    row.layout = found.layout.describe(dims, tuple(found.record.tensor.shape))
    row.order, row.merged, row.split = found.layout.order, found.layout.merged, found.layout.split
    return row


def _parents(name: str, trace: Trace) -> list[str]:
    """The steps `name` is computed from, in this trace (the first of each group of alternatives it holds)."""
    return [next(s for s in group if s in trace) for group in FROM.get(name, ()) if any(s in trace for s in group)]


def _skips(trace: Trace) -> dict[str, torch.Tensor]:
    """Per step from the masked scores on, the rows of queries that may attend to no key, shaped to
    broadcast against the step: attnscope gives them zeros where hand-written code differs, so they are
    left out of the comparison. Empty when there are none."""
    if "masked_scores" not in trace:
        return {}
    import torch

    scores = trace.step("masked_scores")
    empty = torch.isneginf(scores.tensor).all(-1)  # [.., n_Q], dims scores.dims[:-1]
    if not bool(empty.any()):
        return {}
    row_dims = scores.dims[:-1]
    skips: dict[str, torch.Tensor] = {}
    after = False
    for step in trace.steps:
        after = after or step.name == "masked_scores"
        if not after or "n_Q" not in step.dims:
            continue
        rows = empty
        for axis in reversed(range(len(row_dims))):  # fold the axes the step does not have (n_head after the merge)
            if row_dims[axis] not in step.dims:
                rows = rows.any(axis)
        kept = [d for d in row_dims if d in step.dims]
        if tuple(step.dims[: len(kept)]) == tuple(kept):
            # [kept.., 1, ..]: broadcasts over the step
            skips[step.name] = rows.reshape(*rows.shape, *[1] * (len(step.dims) - len(kept)))
    return skips
