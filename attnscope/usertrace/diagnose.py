"""Why a user's tensor differs from the reference step it should equal, told by experiment first: the reference
is run again with each mistake of the catalog (usertrace/experiments.py) applied, and the mistake whose run gives
the user's own tensors back (its output, and the tensor where the line-up diverged) is the cause. Where none does,
the causes below, each tested on the numbers at the diverging step, never read off the source text.

In order: a transposed result (equal once two axes of the same size are swapped), a missing bias
(equal once the Linear's bias is added), heads merged in the wrong order (equal to `x_raw` viewed without
the permute), dropout (entries zeroed, the rest scaled by 1/(1-p)), a mask read the other way round or
not applied, a softmax over the wrong axis (rows not summing to 1 over the keys), a constant ratio (a
scale: √(d_feat / d_head) is the classic one). Else the closest tensor and how far it is.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from attnscope.usertrace.align import VERY_NEGATIVE, Match, ancestors, compare, tolerance
from attnscope.usertrace.diagnosis import Context, Diagnosis, close, equal_record, in_reference_layout, label_of
from attnscope.usertrace.scales import explain_ratio

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnscope.usertrace.record import Record
    from attnscope.usertrace.rerun import Base, Reproduced
    from attnscope.usertrace.trials import Experiment, Trial

ROLE_OF_STEP = {"Q_feat": "q", "K_feat": "k", "V_feat": "v", "x": "o"}
# A step code may compute in one op with the one after it: a mask built with the bias in it (Baichuan's and MPT's
# ALiBi mask, -inf above the diagonal plus m_h · j), added once; or in the other order: q and k normalized after RoPE
# (nanochat's norm without weights, which a rotation keeps), so the code's normed q is the reference's Q_rot normed.
# Where no mistake reproduces the code's tensors at the first, the causes of the second are tried with the first kept
# as the reference has it.
FUSED_AFTER = {"biased_scores": ("masked_scores",), "Q_normed": ("Q_rot",), "K_normed": ("K_rot",)}
# A step code may never hold where it does the next one first: code that masks before it scales (GPT-J's and CodeGen's
# `where(causal_mask, q @ kᵀ, min) / scale_attn`, LLMs-from-scratch's `masked_fill_` then `softmax(s / √d)`) holds the
# product unscaled and the masked scores scaled, never the reference's scaled scores unmasked (`unseen` in correct
# code). Where no mistake reproduces the code's tensors at the first, the mistakes of the later steps are tried
# there, and the divergence is said at the step the experiment reproduced.
HELD_LATER = {"scores": ("biased_scores", "masked_scores")}


def diagnose(step: str, ctx: Context, ranked: list[Match], others: frozenset[int] = frozenset()) -> Diagnosis:
    """The catalog's experiments first (by_experiment); where none reproduces the user's tensors, the causes read
    off the diverging step's numbers, saying so. `others`: the code's tensors the line-up holds for other steps."""
    from attnscope.tensors.threads import one_thread
    from attnscope.usertrace.halfprec import in_code_dtype
    from attnscope.usertrace.rerun import build

    with one_thread():  # the reruns are many small ops: threads only add their hand-offs
        base = in_code_dtype(build(ctx))  # float16 attention: every rerun in the code's dtypes (halfprec.py)
        # no tensor of the step's shape at all (online softmax in blocks never builds the whole scores): the causes
        # are found by the output alone, and the partial tensors the code holds
        found = by_experiment(step, base, absent=not ranked) if base is not None else None
        later = FUSED_AFTER.get(step, ()) if found is None and base is not None else ()
        for fused in later:
            assert base is not None  # `later` is empty without a base
            if fused in base.order:  # the code adds the bias and the mask in one op (Baichuan's ALiBi mask)
                found = by_experiment(fused, base)
                if found is not None:
                    break
        held = HELD_LATER.get(step, ()) if found is None and base is not None else ()
        for after in held:
            assert base is not None  # `held` is empty without a base
            if after in base.order:  # the code masks before it scales: the divergence is at the masked scores
                found = by_experiment(after, base)
                if found is not None:
                    found.step = after
                    break
        if found is None and base is not None:  # two deviations at once, which no one entry reproduces
            from attnscope.usertrace.pairs import by_pair

            found = by_pair(step, base)
    if found is not None:
        return _shown_at_likeliest(found, ranked, others)
    found = _read_off(step, ctx, ranked)
    if base is not None and found.evidence is None and "none of the usual causes fits" not in found.text:
        # no tensor of the step's shape (online softmax over blocks): no numbers of it to read off
        read = f"read off {step}'s numbers alone; " if ranked else "your output differs, and "
        found.evidence = f"not by experiment: {read}no one mistake of trace's catalog, rerun on the reference, gives " \
            "back your output"
    return found


def _shown_at_likeliest(found: Diagnosis, ranked: list[Match], others: frozenset[int]) -> Diagnosis:
    """`found`, said of the likeliest tensor for the step (ranked first: where the step stands in the code's data
    flow), where the tensor the experiment found, the earliest of the same numbers, is one the line-up holds for
    another step (`others`) and the likeliest holds those very numbers: of `value_states = self.k_proj(x)` beside
    `key_states = self.k_proj(x)`, the values are shown at value_states, not at the keys' tensor."""
    near = ranked[0].record if ranked else None
    if near is None or found.record is None or near is found.record or found.reword is None or found.step \
            or found.record.index not in others or near.index in others \
            or (_named(found.record) and not _named(near)):  # a tensor the code names before a nameless one
        return found
    mine, theirs = found.record.tensor, near.tensor
    if mine.shape != theirs.shape or mine.dtype != theirs.dtype or not torch.equal(mine, theirs):
        return found
    found.text, found.evidence = found.reword(near)
    found.record = near
    return found


def _named(record: Record) -> bool:
    """Whether the code gave the tensor a name of its own (not trace's `#15`)."""
    return any(not name.startswith("#") for name in record.names)


def _read_off(step: str, ctx: Context, ranked: list[Match]) -> Diagnosis:
    """Try each cause on the candidates, the most likely first; the first cause that fits one explains the
    divergence. Some causes look through every tensor themselves; dropout is asked of the likeliest candidate
    only (a later tensor of the same shape, after a dropout, is not what went wrong)."""
    from attnscope.usertrace.causes import kernel_dropout, own_mask, repeat_order
    from attnscope.usertrace.headcauses import (
        float16_overflow,
        merged_with_wrong_permute,
        qk_norm,
        split_without_transpose,
    )
    from attnscope.usertrace.maskcauses import alibi, wrong_mask
    from attnscope.usertrace.rotary import diagnose_rope, not_rotated, on_values, untold

    unfed = _unfed(ctx)
    for whole in (_transposed, _merged_before_permute, split_without_transpose,
                  merged_with_wrong_permute, on_values, wrong_mask, alibi):
        found = whole(step, ctx, None) if unfed is None or whole is wrong_mask else None
        if found is not None:
            return found
    checks: tuple[Callable[[str, Context, Match | None], Diagnosis | None], ...] = (
        float16_overflow, _missing_bias, _dropout, kernel_dropout, qk_norm, diagnose_rope, not_rotated, repeat_order,
        own_mask, _mask_inverted, _mask_ignored, _softmax_axis, _ratio, untold)
    if unfed is not None:  # no cause is read off the numbers of queries that saw no key, but the mask's own
        checks = (float16_overflow, _mask_inverted)
    for check in checks:
        for near in ranked[:1] if check in (_dropout, kernel_dropout) else ranked:
            found = check(step, ctx, near)
            if found is not None:
                return found
    if unfed is not None:
        return Diagnosis(f"{label_of(unfed)} leaves queries no key (their weights all 0, or NaN) where the reference's "
                         "mask leaves every query a key: your code masks every key of some queries (a mask it was "
                         "handed read the other way round, or one of its own), and no cause is read off those "
                         f"numbers; {step} is where your code and the reference part", unfed,
                         evidence="not by experiment: no one mistake of trace's catalog, rerun on the reference, "
                         "gives back your output")
    if not ranked:
        return _unplaced(step, ctx)
    near = ranked[0]
    return Diagnosis(f"{label_of(near.record)} has {step}'s shape but not its values (max |diff| "
                     f"{near.max_abs_diff:.3g}); none of the usual causes fits: no mistake of trace's catalog, "
                     f"rerun on the reference, gives your tensors back, so {step} is where your code and the "
                     "reference part", near.record)


def _unplaced(step: str, ctx: Context) -> Diagnosis:
    """The words where no tensor of the code's may stand for `step`: none of its shape at all, or, where some have
    its shape (or a layout of it) but none stands where the step does in the data flow, the nearest of them and how
    far it is (never "none has its shape" where one has)."""
    from attnscope.usertrace.align import candidates

    reference = ctx.reference[step]
    shape = f"[{', '.join(ctx.reference.step(step).dims)}] = {list(reference.shape)}"
    held = candidates(ctx.records, reference, step, ctx.skip.get(step))
    if not held:
        return Diagnosis(f"none of your tensors has {step}'s shape {shape}, or a layout of it")
    near = min(held, key=lambda m: m.max_abs_diff)
    others = f", nor do the {len(held) - 1} other tensors of that shape" if len(held) > 1 else ""
    return Diagnosis(f"{label_of(near.record)} has {step}'s shape {shape} but not its values (max |diff| "
                     f"{near.max_abs_diff:.3g}){others}, and none of them stands where {step} stands in your data "
                     f"flow (made from the tensors lined up with the steps before it, not from those lined up with "
                     f"later ones), so {step} is where your code and the reference part")


def _unfed(ctx: Context) -> Record | None:
    """The code's first pattern where some query saw no key (masking.starved: weights all 0 or NaN) where the
    reference's attention leaves every query some weight; None otherwise."""
    from attnscope.usertrace.masking import no_key, starved

    if "attention" not in ctx.reference or no_key(ctx.reference["attention"]):
        return None
    return starved(ctx.records)


def by_experiment(step: str, base: Base, absent: bool = False) -> Diagnosis | None:
    """The catalog's mistake whose rerun of the reference reproduces the user's tensors: of those that do, the one
    whose run the user's code holds at the most steps, the catalog's order breaking a tie. None where none does.
    `absent`: the code never builds a tensor of `step`'s shape (online softmax over blocks of keys, flash-attention
    style, never holds the whole scores): where no mistake changes a tensor the code holds there, one that
    reproduces its output (and whatever steps it does hold) names the cause."""
    from attnscope.usertrace.experiments import CATALOG
    from attnscope.usertrace.rerun import holds_step, reproduces
    from attnscope.usertrace.trials import SAYS_RERUN, runs

    best: tuple[Experiment, Reproduced, Trial] | None = None
    first = not holds_step(base, step)
    for strict in (first, False) if first and absent else (first,):
        for experiment in CATALOG:
            if strict and not experiment.can_change(base, step):
                continue
            for run in runs(experiment, base):
                trial = run.trial
                found = reproduces(base, step, trial.steps, trial.tol, strict)
                if found is None or (trial.fits is not None and not trial.fits(base, found)):
                    continue
                if best is None or found.held > best[1].held:
                    best = (experiment, found, trial)
        if best is not None:
            break
    if best is None:  # divided attention: a mistake made in some of the code's pieces of the scores alone
        from attnscope.usertrace.gathered import score_pieces
        from attnscope.usertrace.piecetrials import in_some_pieces

        pieces = score_pieces(base.ctx.reference, base.ctx.records)
        for experiment in CATALOG if len(pieces) > 1 else ():
            for made in runs(experiment, base):
                for trial in in_some_pieces(base, made.trial, pieces):
                    found = reproduces(base, step, trial.steps, trial.tol, first)
                    if found is None or (trial.fits is not None and not trial.fits(base, found)):
                        continue
                    if best is None or found.held > best[1].held:
                        best = (experiment, found, trial)
    if best is None:
        return None
    experiment, found, trial = best
    final = found.final

    def words(record: Record | None) -> tuple[str, str]:
        """The mistake said of the code's `record` (its output where None), and the evidence."""
        who = label_of(record) if record is not None else label_of(final)
        gives = label_of(final) if record is None or final is record else f"{who} and {label_of(final)}"
        detail = f"{trial.detail.format(who=who)}; " if trial.detail else ""
        return trial.said(step).format(who=who), f"by experiment: {detail}{SAYS_RERUN.format(gives=gives)}"

    text, evidence = words(found.record)
    earlier = found.earliest if found.earliest is not None and found.earliest[0] != step else None
    return Diagnosis(text, found.record, trial.ratio, experiment.name, evidence, earlier=earlier, reword=words)


# --- the causes ---------------------------------------------------------------------------------------


def _transposed(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    reference = ctx.reference[step]
    dims = ctx.reference.step(step).dims
    tol = tolerance(reference)
    for record in ctx.records:
        for match in compare(record, reference, ctx.skip.get(step), swaps=True, tol=tol):
            if not match.equal or match.layout.merged or match.layout.split is not None:
                continue
            pairs = [(dims[b], dims[a]) for i, a in enumerate(match.layout.order)
                     for b in match.layout.order[i + 1:] if reference.shape[a] == reference.shape[b] and a > b]
            if pairs:
                extra = " (K Qᵀ instead of Q Kᵀ)" if step == "scores" else ""
                return Diagnosis(f"{label_of(record)} is {step} transposed: axes {pairs[0][0]} and {pairs[0][1]} "
                                 f"swapped{extra}; they have the same size here, so the shapes agree and only the "
                                 "numbers tell", record)
    return None


def _missing_bias(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    role = ROLE_OF_STEP.get(step)
    if near is None or role is None or ctx.projections is None:
        return None
    name, linear = ctx.projections.linears[role]
    if linear.bias is None:
        return None
    bias, reference = linear.bias.detach(), ctx.reference[step]
    if reference.shape[-1] != bias.numel() and reference.dim() > 1 and reference.shape[-2] == bias.numel():
        bias = bias[:, None]  # the column form's step, [.., d, n]: the bias a column
    expected = near.layout.apply(reference, tuple(near.record.tensor.shape))
    without = near.layout.apply(reference - bias, tuple(near.record.tensor.shape))
    if close(near.record.tensor, without) and not close(near.record.tensor, expected):
        return Diagnosis(f"{label_of(near.record)} lacks {name}'s bias: it equals {step} minus {name}.bias "
                         f"(the weight applied, the bias never added)", near.record)
    return None


def _merged_before_permute(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    if step != "x_rsh2" or "x_raw" not in ctx.reference:
        return None
    x_raw = ctx.reference["x_raw"]  # [n_batch, n_head, n_Q, d_head]
    wrong = x_raw.reshape(x_raw.shape[0], x_raw.shape[2], -1)  # viewed as [n_batch, n_Q, n_head·d_head] directly
    record = equal_record(ctx.records, wrong)
    if record is not None:
        return Diagnosis(f"heads merged in the wrong order: {label_of(record)} is x_raw [n_batch, n_head, n_Q, "
                         "d_head] viewed as [n_batch, n_Q, d_feat] without first moving n_head behind n_Q "
                         "(view before permute), so each row mixes the positions of one head; "
                         ".permute(0, 2, 1, 3).contiguous() before the view", record)
    return None


_EVAL_DROPOUT = ("dropout is active although the module runs in eval() mode: F.dropout's training argument "
                 "defaults to True; pass training=self.training (or use nn.Dropout)")
# a function has no eval(): trace runs it for inference, as a module in eval() mode
_FUNCTION_DROPOUT = ("dropout is active although trace runs your function for inference: F.dropout's training "
                     "argument defaults to True; pass it a training flag (training=False at inference)")


def _dropout(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    """A dropout in the tensor's history that changed its input: the zeroed share and the scale, measured."""
    if near is None:
        return None
    for index in sorted(ancestors(near.record, ctx.records) | {near.record.index}, reverse=True):
        record = ctx.records[index]
        if record.func != "dropout" or not record.parents:
            continue
        before = ctx.records[record.parents[0]].tensor
        after = record.tensor
        if before.shape != after.shape or torch.equal(before, after):
            continue
        kept = after != 0
        zeroed = float(((~kept) & (before != 0)).sum()) / max(int((before != 0).sum()), 1)
        scale = float((after[kept] / before[kept]).median()) if bool(kept.any()) else math.nan
        measured = (f"line {record.line} zeroed {zeroed:.1%} of {ctx.records[record.parents[0]].label} and "
                    f"scaled the rest by {scale:.3g} (p = {record.details.get('p', float('nan')):g})")
        if ctx.train:
            why = ("the module runs in training mode (--train), where dropout is random; the reference runs "
                   "without dropout: drop --train to compare the computation itself")
        else:
            why = _EVAL_DROPOUT if ctx.kind == "module" else _FUNCTION_DROPOUT
        return Diagnosis(f"{label_of(near.record)} comes through dropout: {measured}; {why}", near.record)
    return None


def _mask_inverted(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    """The masked positions are the allowed ones: very negative scores exactly where the mask allows, or
    the attention's weight all on the keys the mask forbids."""
    found = _mask_view(step, ctx, near)
    if found is None or near is None:
        return None
    user, allowed, rows = found
    if step == "masked_scores":
        very_negative = user <= VERY_NEGATIVE
        on_allowed = float((very_negative & allowed).sum()) / max(int(allowed.sum()), 1)
        on_forbidden = float((very_negative & ~allowed).sum()) / max(int((~allowed).sum()), 1)
        inverted = on_allowed > 0.99 and on_forbidden < 0.01
        share = f"{on_allowed:.0%} of the scores the mask allows are masked, {on_forbidden:.0%} of those it forbids"
    else:
        forbidden_weight = (user * (~allowed)).sum(-1)[rows]
        inverted = bool((forbidden_weight > 0.99).all())
        share = f"all {int(rows.sum())} rows the mask decides put their weight on keys it forbids"
    if not inverted:
        return None
    return Diagnosis(f"the mask is read the other way round: {share}; True is read as masked out "
                     "(nn.MultiheadAttention's attn_mask convention) where the reference reads it as may attend (the "
                     "tutorials' masked_fill(mask == 0, -1e9), F.scaled_dot_product_attention's)", near.record)


def _mask_ignored(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    """Nothing masked: the scores keep every position, or the attention is the unmasked softmax."""
    found = _mask_view(step, ctx, near)
    if found is None or near is None:
        return None
    user, allowed, _ = found
    if step == "masked_scores":
        scores = ctx.reference["scores"].double()
        ignored = close(user, scores) and not bool((user <= VERY_NEGATIVE).any())
    else:
        ignored = close(user, torch.softmax(ctx.reference["scores"].double(), dim=-1))
    if not ignored:
        return None
    return Diagnosis(f"the mask is not applied: {label_of(near.record)} equals the unmasked "
                     f"{'scores' if step == 'masked_scores' else 'softmax'}; the {int((~allowed).sum())} positions "
                     "the mask forbids keep their scores", near.record)


def _mask_view(step: str, ctx: Context, near: Match | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The candidate in the reference's layout, the boolean mask broadcast to it (True = may attend), and
    the rows where the mask decides something; None where a boolean mask does not apply."""
    if near is None or ctx.mask is None or ctx.mask.dtype != torch.bool or step not in ("masked_scores", "attention"):
        return None
    user = in_reference_layout(near, step, ctx)
    mask = ctx.mask.unsqueeze(1) if ctx.mask.dim() == 3 and user.dim() == 4 else ctx.mask  # as the reference does
    try:
        allowed = mask.expand(user.shape)
    except RuntimeError:
        return None
    rows = allowed.any(-1) & (~allowed).any(-1)
    return (user, allowed, rows) if bool(rows.any()) else None


def _softmax_axis(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    if near is None or step != "attention":
        return None
    user = in_reference_layout(near, step, ctx)
    skip = ctx.skip.get(step)
    keep = ~skip.expand(user.shape)[..., 0] if skip is not None else torch.ones(user.shape[:-1], dtype=torch.bool)
    row_sums = user.sum(-1)[keep]
    if bool(((row_sums - 1).abs() < 1e-3).all()):
        return None
    spread = f"row sums from {float(row_sums.min()):.3g} to {float(row_sums.max()):.3g}"
    dims = ctx.reference.step(step).dims
    for axis in range(user.dim() - 2, -1, -1):
        if bool(((user.sum(axis) - 1).abs() < 1e-3).all()):
            where = near.layout.user_axis(axis)
            in_user = f" (your dim={where})" if where is not None else ""
            return Diagnosis(f"{label_of(near.record)} does not sum to 1 over the keys ({spread}): it sums to 1 over "
                             f"{dims[axis]}{in_user}, so the softmax ran over {dims[axis]}, not over n_K "
                             f"(dim=-1 of scores [.., n_Q, n_K])", near.record)
    return Diagnosis(f"{label_of(near.record)} does not sum to 1 over the keys ({spread}) nor over any other axis: "
                     "it is not a softmax over n_K", near.record)


def _ratio(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    if near is None:
        return None
    expected = near.layout.apply(ctx.reference[step], tuple(near.record.tensor.shape)).double()
    user = near.record.tensor.double()
    usable = torch.isfinite(expected) & torch.isfinite(user) & (expected > VERY_NEGATIVE) & (user > VERY_NEGATIVE)
    e, u = expected[usable], user[usable]
    if not e.numel() or float((e * e).sum()) == 0.0:
        return None
    ratio = float((u * e).sum() / (e * e).sum())
    if math.isclose(ratio, 1.0, rel_tol=1e-4) or ratio == 0.0 or not math.isfinite(ratio):
        return None
    if float((u - ratio * e).abs().max()) > tolerance(ratio * e) * 10:  # not a constant ratio
        return None
    return Diagnosis(explain_ratio(step, ratio, ctx), near.record, ratio)
