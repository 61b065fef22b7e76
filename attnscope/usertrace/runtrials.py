"""The catalog's mistakes of the run: the cache joined after the new keys, q @ kᵀ in float16, dropout left on
in eval()."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from attnscope.usertrace.halfprec import own_heads
from attnscope.usertrace.rerun import Base, replay

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record
from attnscope.usertrace.roperead import read_rope, rejoined, rope_turn
from attnscope.usertrace.trialreads import back_row, block_at, user_out
from attnscope.usertrace.trials import Trial


def _join_dim(b: Base) -> str:
    """The axis the code joins its cache on, as its own torch.cat writes it (`dim=1` where it keeps the cache
    sequence-major, cachelayouts.py); `dim=-2`, transformers' layout's, where no join of a cache input is seen."""
    from attnscope.usertrace.cachelayouts import join

    found = join(b.ctx.records)
    return f"dim={found[1]}" if found is not None else "dim=-2"


def trials_cache_order(b: Base) -> Iterator[Trial]:
    if b.cache is None:
        return
    n_new, past = int(b.k_new.shape[-2]), b.n_cache
    words = (f"the cache is joined in the wrong order: {{who}} is what the reference computes with the {n_new} new "
             f"keys and values before the {past} cached ones, torch.cat([k, k_cache]) where the cached positions come "
             f"first: torch.cat([k_cache, k], {_join_dim(b)})")
    rope = read_rope(b) if b.raw_keys is not None else None
    if rope is None:
        yield Trial(replay(b, cat_order="new first"), words)
        return
    # the code rotates the join: the new keys turn at the cache's positions 0 .. n_new − 1, the cached ones after
    steps = rejoined(b, b.q, rope_turn(rope),
                      start=int(rope.k_pos[0]) - past, new_first=True)
    yield Trial(steps, words.replace(" where the cached", f", then rotated together, so the new keys turn at "
                                     f"positions 0 to {n_new - 1}, where the cached"))


def trials_float16(b: Base) -> Iterator[Trial]:
    if not any(r.tensor.dtype in (torch.float16, torch.bfloat16) for r in b.ctx.records):
        return
    # from the code's own heads where it holds them (its projections run in float16: their rounding carried in, so
    # the scores that pass 65504 are the code's own)
    q, k, _ = own_heads(b)
    steps = replay(b, half=True, q=q, k_new=k)
    if bool(torch.isinf(steps["scores"]).any()):
        yield Trial(steps, "float16 overflows: {who} is what the reference computes with q @ kᵀ computed in float16, "
                    f"whose largest number is {torch.finfo(torch.float16).max:.6g}: "
                    f"{int(torch.isinf(steps['scores']).sum())} scores passed it and became inf; compute it in "
                    "float32, or scale q by 1/√d_head before the matmul", tol="float16")


# where a dropout can sit: on the attention weights, or on the output before the heads merge, before the output
# projection or after it (transformers' StarCoder2 `residual_dropout`, nanoGPT's `resid_dropout`)
DROPPED_AT = {"attention": "the attention", "x_raw": "the heads' output", "out": "the output",
              "x_rsh2": "the merged heads (before the output projection)", "x": "the output projection's output"}


def trials_dropout(b: Base) -> Iterator[Trial]:
    """A dropout left on, whatever its form (dropouts.drops: F.dropout, or a keep-mask drawn at random and multiplied
    in by hand, flax's and haiku's ports): the mask it drew, read from its two tensors, applied to the reference
    step its input holds."""
    from attnscope.usertrace.dropouts import drops
    from attnscope.usertrace.dropouts import multiplier as read_mask

    for drop in drops(b.ctx.records):
        record = drop.record
        found = _dropped(b, record, drop.before)
        if found is None:
            continue
        name, after, kept = found
        multiplier = read_mask(kept, after)
        zeroed = float(((after == 0) & (kept != 0)).double().mean())
        runs = "the module runs in eval() mode" if b.kind == "module" else "trace runs your function for inference"
        if drop.own:
            how = (f"line {record.line}'s own dropout (a keep-mask drawn at random, "
                   f"{'p = ' + format(drop.p, '.3g') + ', ' if math.isfinite(drop.p) else ''}{zeroed:.1%} of "
                   f"{DROPPED_AT[name]} zeroed, the rest scaled by 1/(1 − p))")
            fix = ("it is applied whatever the mode: draw it only when training (`if self.training`, flax's "
                   "`deterministic`), as F.dropout(..., training=self.training) does")
        else:
            how = (f"line {record.line}'s dropout (p = {drop.p:g}, {zeroed:.1%} of {DROPPED_AT[name]} zeroed, the rest "
                   "scaled by 1/(1 − p))")
            fix = "F.dropout's training argument defaults to True: " + (
                "pass training=self.training (or use nn.Dropout)" if b.kind == "module" else
                "pass it a training flag (training=False at inference)")
        steps = replay(b, multiplier=multiplier) if name == "attention" else replay(b, dropped={name: multiplier})
        yield Trial(steps, f"dropout is active although {runs}: {{who}} is what the reference computes with {how} "
                    f"applied to its {name}; {fix}")
    yield from _blocked_dropout(b)


def _blocked_dropout(b: Base) -> Iterator[Trial]:
    """Dropout in online softmax (lucidrains' memory-efficient attention, a flash loop in PyTorch): each block's
    exp(scores − max) dropped out, the block placed where its scores stand in the reference's (its matmul's values
    found there); the reference's attention times that multiplier, as flash-attention drops the normalized weights,
    and renormalized by the dropped weights' sum, as code that sums the dropped block does."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.flow import EXPONENTS
    from attnscope.usertrace.record import SOFTMAXES

    records = b.ctx.records
    if b.col or "attention" not in b.ref or any(r.func in SOFTMAXES for r in records):
        return
    scores, attention = b.ref["scores"], b.ref["attention"]
    multiplier, line, p = torch.ones_like(attention), None, float("nan")
    for record in records:
        if record.func != "dropout" or not record.parents:
            continue
        before = records[record.parents[0]]
        above = sorted(ancestors(before, records) | {before.index}, reverse=True)
        if torch.equal(before.tensor, record.tensor) or not any(records[i].func in EXPONENTS for i in above):
            continue
        # the nearest tensor it is made from that holds a block of the reference's scores (q · kᵀ, scaled)
        at = next((found for i in above if records[i].tensor.shape == before.tensor.shape
                   and records[i].tensor.is_floating_point()
                   and (found := block_at(records[i].tensor.double(), scores)) is not None), None)
        if at is None:
            return
        kept, after = before.tensor.double(), record.tensor.double()
        rows, cols = at[0], at[1]
        multiplier[..., rows:rows + kept.shape[-2], cols:cols + kept.shape[-1]] = torch.where(
            kept != 0, after / kept.where(kept != 0, torch.ones_like(kept)), 0.0)
        line, p = line or record.line, float(record.details.get("p", p))
    if line is None:
        return
    said = (f"dropout is active although the module runs in eval() mode: {{who}} is what the reference computes with "
            f"line {line}'s dropout (p = {p:g}) applied to each block of its attention")
    fix = "; F.dropout's training argument defaults to True: pass training=self.training"
    yield Trial(replay(b, multiplier=multiplier), said + fix)
    dropped = attention * multiplier
    total = dropped.sum(-1, keepdim=True)
    renormed = torch.where(total > 0, multiplier / total.where(total > 0, torch.ones_like(total)), 0.0)
    yield Trial(replay(b, multiplier=renormed), said + ", the dropped weights summed as the normalizer" + fix)


def _dropped(b: Base, record: Record, before: Record) -> tuple[str, torch.Tensor, torch.Tensor] | None:
    """(the reference step the dropout's input holds, the dropout's output and input laid out as that step), the
    first of DROPPED_AT's steps that it equals; None where it holds none."""
    from attnscope.usertrace.align import compare, tolerance

    for name in DROPPED_AT:
        if name not in b.ref:
            continue
        # the attention in the code's layout; in the column form also the row form's, where the code's weights are
        # [.., n_Q, .., n_K] all the same (timm's einsum 'bnhk,bmk->bnhm' on a feature map read as columns)
        forms = [(user_out(b, name), True), *([(b.ref[name], False)] if b.col else [])] if name == "attention" \
            else [(b.ref[name], False)]
        for step, turned in forms:
            # to the tolerance of the user's dtype (a function's reference runs in float64)
            tol = tolerance(step, before.tensor.dtype) if before.tensor.is_floating_point() else None
            match = next(iter(compare(before, step, b.ctx.skip.get(name), tol=tol)), None)
            if match is None or not match.equal:
                continue
            shape = tuple(step.shape)
            after, kept = (match.layout.undo(t.double(), shape) for t in (record.tensor, before.tensor))
            if turned:
                after, kept = back_row(b, after), back_row(b, kept)
            return name, after, kept
    return None
