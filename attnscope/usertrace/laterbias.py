"""A projection's bias the code adds after it has cut the output apart: `q, k, v = self.qkv(x).chunk(3, -1)` then
`q = q + self.q_bias`, `v = v + self.v_bias` (the keys left without one, as BEiT's and Whisper's are), or a bias
added once the heads are split (`q.view(b, n, h, d) + self.b_q`, a `[n_head, d_head]` one).

Read from the values: the tensor the parameter is added to holds values of the projection's output alone, which
says the rows it reads (each value looked up in the output, as fused.solve_rows does); the parameter, broadcast over
it, is those rows' bias. Rows no such add reaches have none (zero); rows two parameters are added to are no
projection's bias (Transformer-XL's `q + r_w_bias` for the content, `q + r_r_bias` for the positions: ownterm.py
reads those). The projection then reads like a Linear with that bias (fused.Part), so the reference's projected q,
k, v are the code's after the add.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record

ADDS = ("add", "__add__", "__radd__")


def added(name: str, linear: Any, records: list[Record], params: dict[str, Any]) -> Any:
    """`linear` as a fused.Part whose bias holds what the code adds to parts of its output after the fact; `linear`
    itself where it has a bias of its own, or no such add is found."""
    from attnscope.usertrace.fused import Part, row_order
    from attnscope.usertrace.valueindex import ValueIndex

    made = [r for r in records if r.style == "linear" and r.args and r.args[0] == ("text", name)]
    weight = getattr(linear, "weight", None)
    if getattr(linear, "bias", None) is not None or len(made) != 1 or not isinstance(weight, torch.Tensor) \
            or not made[0].tensor.is_floating_point():
        return linear
    output = made[0].tensor.detach()
    width = int(output.shape[-1])
    lookup = ValueIndex.of(output)
    if width != weight.shape[0] or lookup is None:
        return linear
    bias = torch.zeros(width, dtype=weight.dtype, device=weight.device)
    reached = torch.zeros(width, dtype=torch.bool)
    for record in records[made[0].index + 1:]:
        if record.func not in ADDS or len(record.args) != 2:
            continue
        given = [v for k, v in record.args if k == "text" and v in params]
        parts = [v for k, v in record.args if k == "rec"]
        if len(given) != 1 or len(parts) != 1 or parts[0] == made[0].index:
            continue
        operand, param = records[parts[0]].tensor, params[given[0]].detach()
        if operand.dtype != output.dtype or tuple(record.tensor.shape) != tuple(operand.shape):
            continue
        source = lookup.positions(operand.detach())
        if source is None:
            continue
        read = row_order(source % width, source // width)
        if read is None or not read:
            continue
        if bool(reached[read].any()):  # two parameters added to the same rows (Transformer-XL's q + u, q + v): terms
            return linear
        held = _per_row(param, operand, len(read))
        if held is None:
            continue
        bias[read], reached[read] = held.to(bias.dtype), True
    if not bool(reached.any()):
        return linear
    return Part(name, weight.detach(), bias)


def _per_row(param: torch.Tensor, operand: torch.Tensor, count: int) -> torch.Tensor | None:
    """The parameter's value for each of the `count` rows the operand reads (in its order: the row axes last), where
    it broadcasts over the operand's last axes; None otherwise."""
    shape = list(param.shape)
    while shape and shape[0] == 1:
        shape.pop(0)
    if not shape or len(shape) > operand.dim() or tuple(operand.shape[-len(shape):]) != tuple(shape):
        return None
    flat = param.reshape(-1)
    if flat.numel() == count:
        return flat
    if count % flat.numel() == 0:
        return flat.repeat(count // flat.numel())
    return None
