"""A learned per-channel gain on what the attention returns, after its output projection: timm's LayerScale
(`ls1(attn(x))`, `x * self.gamma`, or in place `x.mul_(gamma)`), CaiT's and DeiT III's `gamma_1 * attn(x)`, ConvNeXt-
style `layer_scale`, a learned scalar `alpha`, whatever the module calls it.

Such a gain is a convention: `diag(g) · (W_o·x + b)` is an output projection with its rows (and bias) times g, so the
attention pattern is untouched and the weights could hold it either way. It is read where every step of the
reference has found its equal but what the code returns differs from the last one: walking the data flow from the
code's tensor lined up with that step to the one it returns, every op rearranges or passes values on, but for
multiplications by a tensor computed from the module's parameters alone (no input), of one number or of one per
output feature. Then the experiment: the reference's step times the gain(s), laid on the last axis, must give back
what the code returns; only then is it said, in a note naming the gain, and the line-up ends at that step.

The same parameter on the way twice (`ls(ls(x))`, the gain applied again) is no convention read here: the return
stays the divergence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace.record import MULTIPLIES

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record

PASSES = ("dropout", "identity")  # eval-mode dropout hands its input back


@dataclass
class Gain:
    words: str  # the code's words for it: ls1.gamma
    value: torch.Tensor  # [1] or [width]
    line: int


def read(held: Record, returned: Record, records: list[Record], params: dict[str, Any], step: torch.Tensor,
         skip: torch.Tensor | None, name: str) -> str | None:
    """The note saying the per-channel gain(s) between `held` (the code's tensor lined up with the reference's last
    step `name`, `step`) and `returned`, where the experiment confirms them; None otherwise."""
    from attnscope.usertrace.align import REARRANGING, compare

    gains: list[Gain] = []
    index = returned.index
    while index != held.index:
        record = records[index]
        on = [value for kind, value in record.args if kind == "rec" and _from(value, held.index, records)]
        if len(on) != 1 or on[0] >= index:
            return None
        if record.func in MULTIPLIES:
            gain = _gain([a for a in record.args if a != ("rec", on[0])], records, params, step.shape[-1])
            if gain is None:
                return None
            gains.append(Gain(gain[0], gain[1], record.line))
        elif record.func not in REARRANGING + PASSES or record.tensor.numel() != step.numel():
            return None
        index = on[0]
    words = [g.words for g in gains]
    if not gains or len(set(words)) < len(words):
        return None
    scale = torch.ones(step.shape[-1], dtype=step.dtype)
    for g in gains:
        scale = scale * g.value.to(step.dtype).reshape(-1)
    matches = compare(returned, step * scale, skip)
    if not matches or not matches[0].equal:
        return None
    said = " · ".join(words)
    after, where = ("its output projection", "output projection's rows (diag(g)·W_o, its bias times g too)") \
        if name == "x" else ("the merge of its heads", "value projection's rows, head by head")
    shape = "one number" if all(g.value.numel() == 1 for g in gains) else f"one per output feature, [{step.shape[-1]}]"
    return (f"your code multiplies its output by {said} (line {gains[0].line}) after {after}: a learned gain of "
            f"your module's own ({shape}; LayerScale's, as timm's and CaiT's blocks hold it), a convention, not a "
            f"mistake: it folds into the {where} and leaves the pattern as it is; the reference's {name} times it "
            f"gives back what your code returns (max |diff| {matches[0].max_abs_diff:.1e}), so the line-up ends at "
            f"{name}")


def _from(index: int, held: int, records: list[Record]) -> bool:
    """Whether record `index` is `held` or computed from it."""
    from attnscope.usertrace.align import ancestors

    return index == held or held in ancestors(records[index], records)


def _gain(others: list[tuple[str, Any]], records: list[Record], params: dict[str, Any], width: int
          ) -> tuple[str, torch.Tensor] | None:
    """(its words, its values) where the one other operand of a multiplication is a tensor of the module's
    parameters alone holding one number or one per feature, laid on the last axis (`[width]`, `[1, 1, width]`)."""
    from attnscope.usertrace.linearweights import parameters_read
    from attnscope.usertrace.record import render_op

    if len(others) != 1:
        return None
    kind, value = others[0]
    if kind == "text" and value in params:
        tensor, words = params[value].detach(), str(value)
    elif kind == "rec" and parameters_read(value, records, params):
        record = records[value]
        tensor = record.tensor.detach()
        words = record.label if record.names else render_op(record.call, record.style, record.args,
                                                            lambda i: records[i].label)
    else:
        return None
    if not tensor.is_floating_point() or tensor.numel() not in (1, width) or (
            tensor.numel() == width and tensor.shape[-1] != width):
        return None
    return words, tensor
