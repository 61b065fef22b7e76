"""A batch norm in eval mode right after a projection: LeViT's `MLPLayerWithBN` (a Linear without bias, then
`BatchNorm1d` over `hidden.flatten(0, 1)`, `reshape_as` back), and the same after a convolution's 1x1 in other
vision code. In eval mode the norm is a scale and a shift per output channel, `a · (W x + b) + c`, so the pair is
one projection, `(a W) x + (a b + c)`: the tensor after the norm is what the code's projection makes, the one its
q, k and v are cut from (fused.py reads its rows by their values there).

Read from the run: a `batch_norm` op not in training mode whose input is a Linear's output through reshapes alone
and whose output, through reshapes alone, is back in that output's shape; `a` and `c` are solved per channel from the
two tensors (least squares, then checked to tolerance), whatever the norm's own parameters hold. The record of the
tensor after the norm then stands for the projection's call (`details["norm_folded"]` holding `a` and `c`), the
Linear's own call is kept under another name, and projections.py holds the Linear as `a W`, `a b + c` (`folded`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace.align import tolerance

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record

RESHAPES = ("view", "reshape", "flatten", "unflatten", "contiguous", "view_as", "reshape_as")
NORMS = ("batch_norm",)


def merged(records: list[Record]) -> list[Record]:
    """`records` with each projection followed by an eval-mode batch norm read as one projection (in place)."""
    for norm in records:
        if norm.func not in NORMS or any(kind == "text" and "training=True" in str(value)
                                         for kind, value in norm.args):
            continue
        linear = _through(records, _first(norm))
        if linear is None or linear.style != "linear" or linear.details.get("norm_folded") is not None:
            continue
        after = _down(records, norm, tuple(linear.tensor.shape))
        if after is None:
            continue
        fit = _per_channel(linear.tensor, after.tensor)
        if fit is None:
            continue
        after.details["norm_folded"] = fit
        after.details["norm_record"] = norm.index
        after.func, after.call, after.style = linear.func, linear.call, linear.style
        after.args, after.parents = list(linear.args), linear.parents
        for key in ("weight", "contracts", "weight_record", "source_shape"):
            if key in linear.details:
                after.details[key] = linear.details[key]
        name = linear.args[0][1] if linear.args and linear.args[0][0] == "text" else "linear"
        linear.args = [("text", f"{name} (before its batch norm)"), *linear.args[1:]]
        linear.style = "function"
    return records


def note(records: list[Record]) -> str | None:
    """The note for the projections `merged` read with their batch norms; None where it read none."""
    found = [r for r in records if r.details.get("norm_folded") is not None and r.args and r.args[0][0] == "text"]
    if not found:
        return None
    said = "; ".join(f"{r.args[0][1]} then {_norm_name(records[r.details['norm_record']])} (line "
                     f"{records[r.details['norm_record']].line})" for r in found)
    return (f"your projections are followed by a batch norm in eval mode ({said}): a scale and a shift per channel, "
            "read as one projection, a·W and a·b + c, which the reference holds; a convention, not a mistake")


def folded(name: str, linear: Any, records: list[Record]) -> Any:
    """The Linear `name` as the one projection it makes with the batch norm after it (fused.Part: `a W`, `a b + c`),
    where `merged` read one; `linear` as it is otherwise."""
    from attnscope.usertrace.fused import Part

    calls = [r for r in records if r.style == "linear" and r.args and r.args[0] == ("text", name)
             and r.details.get("norm_folded") is not None]
    weight = getattr(linear, "weight", None)
    if len(calls) != 1 or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return linear
    a, c = calls[0].details["norm_folded"]
    if a.numel() != weight.shape[0]:
        return linear
    bias = getattr(linear, "bias", None)
    own = bias.detach().double() if isinstance(bias, torch.Tensor) else torch.zeros_like(a)
    return Part(name, (a[:, None] * weight.detach().double()).to(weight.dtype), (a * own + c).to(weight.dtype))


def _norm_name(norm: Record) -> str:
    """The norm's module (`qkv.batch_norm`), read off its running mean's name; `F.batch_norm` otherwise."""
    for kind, value in norm.args:
        if kind == "text" and str(value).endswith(".running_mean"):
            return str(value).removesuffix(".running_mean")
    return "F.batch_norm"


def _first(record: Record) -> int | None:
    return next((value for kind, value in record.args if kind == "rec"), None)


def _through(records: list[Record], index: int | None) -> Record | None:
    """The record `index` leads to through reshapes alone, back towards what it was made from."""
    while index is not None:
        record = records[index]
        if record.func not in RESHAPES:
            return record
        index = _first(record)
    return None


def _down(records: list[Record], start: Record, shape: tuple[int, ...]) -> Record | None:
    """The first record made from `start` through reshapes alone whose shape is `shape`; None where another op, or
    more than one, takes it first."""
    current = start
    while True:
        users = [r for r in records[current.index + 1:] if _first(r) == current.index]
        if len(users) != 1 or users[0].func not in RESHAPES:
            return None
        current = users[0]
        if tuple(current.tensor.shape) == shape:
            return current


def _per_channel(before: torch.Tensor, after: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`(a, c)` with `after = a · before + c` per channel (the last axis), float64, to tolerance; None otherwise."""
    x = before.detach().double().reshape(-1, before.shape[-1])
    y = after.detach().double().reshape(-1, after.shape[-1])
    if x.shape != y.shape or x.shape[0] < 2:
        return None
    dx, dy = x - x.mean(0), y - y.mean(0)
    spread = (dx * dx).sum(0)
    if bool((spread == 0).any()):
        return None
    a = (dx * dy).sum(0) / spread
    c = y.mean(0) - a * x.mean(0)
    if float((a * x + c - y).abs().max()) > tolerance(after.detach().float()):
        return None
    return a, c
