"""--train: the user's dropout, read off their tensors and applied to the reference, so that the steps after it
can still be compared and the first real divergence found.

In training mode a dropout zeroes entries at random and scales the rest by 1/(1-p). Where the user's dropout
input equals the reference's `attention` (its softmax, the usual place: the Annotated Transformer's and
nanoGPT's `attn_dropout`), the multiplier it applied (`after / before`: 0 or 1/(1-p) per entry) is read from
the two recorded tensors and applied to the reference's attention; the steps after it (`x_raw ... x`, or
`out`) are computed again from that. A dropout elsewhere (on the output, nanoGPT's `resid_dropout`) changes
nothing the reference compares before it. `F.scaled_dot_product_attention(dropout_p=...)` drops inside its
kernel, where the mask cannot be read; diagnose.py says so.

A dropout is read from what the code computes, whatever form it takes (`drops`): `F.dropout` (nn.Dropout), or one
written by hand, as ports of JAX code write it (flax's `attn_weights * (bernoulli(keep_prob) / keep_prob)`, haiku's
`keep * x / keep_rate`), or `mask = torch.rand_like(x) > p; x * mask / (1 - p)`: a tensor of the code's equal to an
earlier one (made from nothing random) times a mask of two values, 0 and one scale, where the mask comes from a random
op (torch.bernoulli, rand, rand_like, ...). The mask it drew is read from the two tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnscope.trace import Trace
from attnscope.usertrace.align import ancestors, compare

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record


# ops that draw at random: what a dropout's keep-mask is made from (the functions, methods and in-place forms)
RANDOM = ("bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like",
          "uniform_", "normal_", "multinomial", "randperm", "dropout", "alpha_dropout", "feature_alpha_dropout",
          "dropout1d", "dropout2d", "dropout3d")
# the ops a hand-written dropout applies its mask with
APPLIES = ("mul", "__mul__", "__rmul__", "mul_", "div", "true_divide", "__truediv__", "div_", "where", "masked_fill",
           "masked_fill_")


@dataclass(frozen=True)
class Drop:
    """A dropout the code applied: `record` is `before` with entries zeroed at random and the rest scaled; `p` the
    share it drops (its call's, or 1 − 1/scale read from the kept entries); `own`: written by hand, not F.dropout."""

    record: Record
    before: Record
    p: float
    own: bool = False


def drops(records: list[Record]) -> list[Drop]:
    """Every dropout that changed its input, in the order the code ran them: `F.dropout`'s (nn.Dropout's), then
    those written by hand (`x * keep / keep_prob`, a keep-mask drawn at random): for each tensor made with a
    random op in its history by an op that applies a mask, each earlier tensor of its shape made from nothing random
    that it equals times a mask of 0 and one scale (some entries zeroed, the rest all scaled alike), the last such op
    of each (`x * keep` and then `/ keep_prob`: the second, which the code goes on with)."""
    found = [Drop(r, records[r.parents[0]], float(r.details.get("p", math.nan))) for r in records
             if r.func == "dropout" and r.parents and not torch.equal(records[r.parents[0]].tensor, r.tensor)]
    random: set[int] = set()
    for r in records:  # in order: a record's parents come before it
        if r.func in RANDOM or any(p in random for p in r.parents):
            random.add(r.index)
    own: dict[int, Drop] = {}  # by the tensor dropped: the last op that drops it (`x * keep`, then `/ keep_prob`)
    for r in records:
        if r.index not in random or r.func not in APPLIES or r.func == "dropout" or not r.tensor.is_floating_point():
            continue
        for i in sorted(ancestors(r, records), reverse=True):
            before = records[i]
            if i in random or before.tensor.shape != r.tensor.shape or not before.tensor.is_floating_point():
                continue
            scale = _kept_scale(before.tensor, r.tensor)
            if scale is not None:
                own[i] = Drop(r, before, 1 - 1 / scale if scale > 1 else math.nan, own=True)
    return found + sorted(own.values(), key=lambda d: (d.record.index, -d.before.index))


def multiplier(kept: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """The mask a dropout drew, read off its input `kept` and its result `after`: after / kept where kept is not 0,
    0 elsewhere."""
    return torch.where(kept != 0, after / kept.where(kept != 0, torch.ones_like(kept)), 0.0)


def _kept_scale(before: torch.Tensor, after: torch.Tensor) -> float | None:
    """The one scale `after` holds `before`'s kept entries at, where it is `before` with some of its nonzero entries
    zeroed and every other scaled alike (to float32's tolerance); None otherwise."""
    x, y = before.detach().double(), after.detach().double()
    live = x != 0
    zeroed = live & (y == 0)
    kept = live & (y != 0)
    if not bool(zeroed.any()) or not bool(kept.any()) or bool(((~live) & (y != 0)).any()):
        return None
    ratio = y[kept] / x[kept]
    scale = float(ratio.median())
    if scale <= 0 or float((ratio - scale).abs().max()) > 1e-5 * scale:
        return None
    return scale


def with_users_dropout(trace: Trace, records: list[Record], reference: Any) -> tuple[Trace | None, str] | None:
    """The reference with the user's attention dropout applied after `attention` (no trace when there is none
    to apply: the steps before the dropout are still compared), and a note saying what was done; None when no
    dropout of the user's dropped anything. F.dropout in training mode, or one written by hand (`drops`)."""
    dropouts = [d for d in drops(records) if d.own or d.record.details.get("training")]
    if not dropouts:
        return None
    if "attention" not in trace:
        return None, _unapplied(dropouts[0])
    attention = trace["attention"]
    for drop in dropouts:
        record, before = drop.record, drop.before
        match = next(iter(compare(before, attention)), None)
        if match is None or not match.equal:  # merged too: heads folded into the batch, or a module of one head
            continue  # whose [n_batch, n_Q, n_K] is the attention's [n_batch, 1, n_Q, n_K]
        shape = tuple(attention.shape)
        after = match.layout.undo(record.tensor, shape).to(attention.dtype)
        kept = match.layout.undo(before.tensor, shape).to(attention.dtype)
        p = drop.p if math.isfinite(drop.p) else 0.0
        multiplier = torch.where(kept != 0, after / kept.where(kept != 0, torch.ones_like(kept)),
                                 torch.where(after == 0, 0.0, 1 / (1 - p) if p < 1 else 0.0))
        zeroed = float((multiplier == 0).double().mean())
        note = (f"dropout in training mode: line {record.line} zeroed {zeroed:.1%} of the attention (p = {p:.3g}); "
                "the reference applies that same mask, read from your tensors, after its attention, so the steps "
                "after it are still compared")
        return _after_attention(trace, attention * multiplier, reference), note
    return None, _unapplied(dropouts[0])


def _unapplied(drop: Drop) -> str:
    record, before = drop.record, drop.before
    zeroed = float(((record.tensor == 0) & (before.tensor != 0)).double().mean())
    p = f" (p = {drop.p:.3g})" if math.isfinite(drop.p) else ""
    return (f"dropout in training mode: line {record.line} zeroed {zeroed:.1%} of {before.label} at random{p}; "
            "its input matches no reference step to apply the same mask to, so the steps before it are compared, and "
            "those after it differ by that")


def _after_attention(trace: Trace, dropped: torch.Tensor, reference: Any) -> Trace:
    """The trace with every step after `attention` computed again from `dropped`."""
    from attnscope.attention.stages import heads_last

    out = Trace(notes=list(trace.notes))
    after = False
    values = next(name for name in ("V_rep", "V_cat", "V_split", "V") if name in trace)
    col = trace.step("attention").dims[-1] == "n_Q"  # the column form's [.., n_K, n_Q] (usertrace/columns.py)
    for step in trace.steps:
        if not after:
            out.add_step(step)
            after = step.name == "attention"
            continue
        if step.name in ("x_raw", "out") and col:
            tensor = trace[values].to(dropped.dtype) @ dropped  # [.., d, n_K] @ [.., n_K, n_Q] -> [.., d, n_Q]
        elif step.name in ("x_raw", "out"):
            tensor = dropped @ trace[values].to(dropped.dtype)  # [.., n_Q, n_K] @ [.., n_K, d] -> [.., n_Q, d]
        elif step.name == "x_rsh2" and col:
            tensor = out["x_raw"].reshape(step.shape)  # [n_batch, n_head, d_head, n_Q] -> [n_batch, d_feat, n_Q]
        elif step.name == "x" and col:
            with torch.no_grad():  # W_o on the rows, [n_batch, n_Q, d_feat], then back to columns
                tensor = reference.W_o(out["x_rsh2"].transpose(-2, -1)).transpose(-2, -1)
        elif step.name == "x_rsh1":
            tensor = heads_last(out["x_raw"])  # [n_batch, n_Q, n_head, d_head]
        elif step.name == "x_rsh2":
            tensor = out["x_rsh1"].reshape(step.shape)  # [n_batch, n_Q, n_head·d_head]
        elif step.name == "x":
            with torch.no_grad():
                tensor = reference.W_o(out["x_rsh2"])  # [n_batch, n_Q, d_feat]
        else:
            tensor = step.tensor
        out.add(step.name, tensor, step.dims, f"{step.op}, with your dropout's mask", step.flops, step.allocates)
    return out
