"""An output gate: the merged heads (or each head's output) multiplied elementwise, before the output projection, by
a factor the code computes from its input: OpenFold's and AlphaFold's `o * sigmoid(linear_g(q_x))`, Qwen3-Next's
`attn_output * sigmoid(gate)` with the gate from the query projection's extra half, the gated-attention papers'
elementwise or per-head gates.

Read off the data flow, as the code's own term on its output is (outterm.py): a multiplication one of whose
operands is the code's `attn @ v` (the tensor the line-up pairs with x_raw) or a rearranging of it, and the other a
tensor computed from a projection of the input, never from the attention. The gate is taken from the run, as the
code multiplies by it, in the reference's x_raw layout `[n_batch, n_head, n_Q, d_head]`; the reference multiplies
its merged heads by it (steps `gate`, `x_gated`, as Qwen3-Next's page has them) and projects that, so every step is
still compared, and a rerun of a catalog mistake upstream (the scale, the merge, the keys and values) multiplies by
the same gate: mistakes before it are named by experiment. A gate that is itself wrong is not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace import gatetokens
from attnscope.usertrace.align import Layout, ancestors, layouts
from attnscope.usertrace.outterm import downstream
from attnscope.usertrace.record import MULTIPLIES

if TYPE_CHECKING:
    from attnscope.trace import Trace
    from attnscope.usertrace.record import Record

HEADS_LAST = (0, 2, 1, 3)  # x_raw [n_batch, n_head, n_Q, d_head] as [n_batch, n_Q, n_head, d_head]
TAIL = ("x_rsh2", "x")


@dataclass
class OutGate:
    tensor: torch.Tensor  # the gate as the code multiplies by it, in the reference's x_raw layout
    before_merge: bool  # the code gates each head's output as attn @ v lays it out, before the heads merge
    note: str
    mixes_tokens: bool = False  # the code's gate gives query n another token's factor (gatetokens.py): not read


def found(records: list[Record], lined: Any) -> OutGate | None:
    """The gate the code multiplies its `attn @ v` by (the record the line-up `lined` pairs with x_raw, or a
    rearranging of it), in the reference's x_raw layout, and the note that says it; None where there is none."""
    trace = lined.trace
    row = next((r for r in lined.rows if r.reference == "x_raw" and r.record is not None), None)
    pattern = next((r.record for r in lined.rows if r.reference == "attention" and r.record is not None), None)
    if trace is None or row is None or pattern is None or "x_raw" not in trace or trace["x_raw"].dim() != 4:
        return None
    shape = tuple(trace["x_raw"].shape)
    made = row.record
    if made.index < pattern.index or made.tensor.numel() != trace["x_raw"].numel():
        return None
    held = Layout(row.order, row.merged, row.split).undo(made.tensor, shape).double() if row.order is not None \
        else None
    for record, given, moved in downstream(made, records):
        mine = [v for v in given if v in moved]
        if record.func not in MULTIPLIES or len(mine) != 1 or not record.tensor.is_floating_point():
            continue
        operand = records[mine[0]]
        others = [a for a in record.args if a != ("rec", mine[0])]
        if tuple(record.tensor.shape) != tuple(operand.tensor.shape) or len(others) != 1 or others[0][0] != "rec":
            continue
        gate = records[others[0][1]]
        up = ancestors(gate, records) | {gate.index}
        if made.index in up or pattern.index in up or not any(records[i].style == "linear" for i in up):
            continue  # from the attention, or from no projection of the input: no gate
        try:
            factor = gate.tensor.expand(operand.tensor.shape)
        except RuntimeError:
            continue
        layout = _layout_of(operand, held, shape)
        if layout is None:
            return None
        tok = gatetokens.tokens(gate, records, shape[2])
        if tok is not None and not gatetokens.own_tokens(layout.undo(tok.expand(operand.tensor.shape), shape)):
            return OutGate(factor, False, _mixing(record, gate), True)  # a mistake of the code, not read
        tensor = layout.undo(factor, shape).double()
        if not bool(torch.isfinite(tensor).all()):
            return None
        return OutGate(tensor.float(), layout.same, _note(record, gate))
    return None


def _layout_of(operand: Record, held: torch.Tensor | None, shape: tuple[int, ...]) -> Layout | None:
    """How `operand` (the code's `attn @ v`, or that rearranged) lays out the reference's x_raw: the layout under
    which it holds `held`'s values; where none does (a merge without the transpose before the gate), the layout its
    shape says, the heads after the queries first (the code's merge as it meant it)."""
    found = layouts(shape, tuple(operand.tensor.shape))
    if held is not None:
        for layout in found:
            if torch.equal(layout.undo(operand.tensor, shape).double(), held):
                return layout
    return next((layout for layout in found if layout.order == HEADS_LAST), found[0] if found else None)


def _mixing(record: Record, gate: Record) -> str:
    return (f"your code gates its attention's output (line {record.line}) with {gate.label} (line {gate.line}), "
            "computed from your input, but in another layout than the output it multiplies: query n's output is "
            "multiplied by a factor made from another token's input (a gate laid out [n_batch, n_Q, n_head·d_head] "
            "read as [n_batch, n_head, n_Q, d_head], say); the reference does not take that gate as a convention")


def _note(record: Record, gate: Record) -> str:
    made = record.details.get("op", record.label)
    return (f"your code gates its attention's output (line {record.line}: {made}; {gate.label}, line {gate.line}, is "
            "computed from your input, not from the attention), as OpenFold's and Qwen3-Next's gated attention do: "
            "the reference multiplies its merged heads by your gate, as your run computes it, before the output "
            "projection; a convention, not a mistake")


def gated(trace: Trace, gate: torch.Tensor, reference: Any) -> Trace:
    """The reference's run with its merged heads multiplied by the code's gate (steps `gate` and `x_gated` after
    x_rsh2, as Qwen3-Next's page records them) and projected again."""
    from attnscope.attention.stages import merge_heads, wide
    from attnscope.trace import Trace

    if any(name not in trace for name in TAIL) or tuple(trace["x_raw"].shape) != tuple(gate.shape):
        return trace
    out = Trace(notes=list(trace.notes))
    for step in trace.steps:
        if step.name != "x":
            out.add_step(step)
    merged = trace.step("x_rsh2")
    factor = out.add("gate", merge_heads(gate.to(merged.tensor.dtype)), merged.dims,  # [n_batch, n_Q, width]
                     "your gate, as your run computes it, heads merged")
    x_gated = out.add("x_gated", merged.tensor * factor, merged.dims, "x_rsh2 * gate", merged.tensor.numel(),
                      inputs=("x_rsh2", "gate"))
    with torch.no_grad():
        x = wide(reference.W_o, x_gated)  # [n_batch, n_Q, d_feat]
    out.add("x", x, ("n_batch", "n_Q", "d_feat"), "W_o(x_gated)",
            ("linear", x.shape, x_gated.shape[-1], reference.W_o.bias is not None), inputs=("x_gated",))
    return out
