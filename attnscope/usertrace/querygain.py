"""A learned gain per coordinate on the queries: TimesFM's `_scale_query`, `query * softplus(self.scaling) *
1.442695041 / √head_dim` (its `_per_dim_scaling`), one factor for each of a head's d_head coordinates, the same in
every head, computed from a parameter of the module's own; the attention then runs with `scaling=1.0`.

Read from the data flow, as valuegain.py reads the values' gain: walking up from the scores' left operand to the
projection that made it, each multiplication whose other operand is computed from the module's parameters alone and
holds one number per coordinate (`[d_head]`, its other axes 1) is a gain. The reference's query projection holds it
(each head's rows times the gain), a convention of the module's and a note; lineup.py reads the scale beside it (the
gain is the whole scale, as TimesFM's, or the code scales again) by which lines up."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Projections


@dataclasses.dataclass
class QueryGain:
    values: torch.Tensor  # [d_head]
    what: str  # the code's words for it: #12, or its name
    line: int


def find(records: list[Record], params: dict[str, Any]) -> QueryGain | None:
    """The product of the learned gains per coordinate on the queries' way from their projection to the scores;
    None where there is none, a scalar one (the scale's experiments read those), or the flow does not say it."""
    from attnscope.usertrace import flow
    from attnscope.usertrace.valuegain import gains_up

    found = flow.operands(records)
    if found is None:
        return None
    read = gains_up(records, found[0], lambda record, others: _per_coordinate(others, records, params,
                                                                               int(record.tensor.shape[-1])))
    gains = [QueryGain(values, words, line) for values, words, line in read or ()]
    if not gains:
        return None
    total = gains[0].values
    for gain in gains[1:]:
        total = total * gain.values
    if float(total.max() - total.min()) <= 1e-6 * float(total.abs().max()):
        return None  # one number for every coordinate: a scale, which the catalog's experiments read
    return QueryGain(total, " · ".join(g.what for g in gains), gains[0].line)


def _per_coordinate(others: list[tuple[str, Any]], records: list[Record], params: dict[str, Any],
                    width: int) -> tuple[torch.Tensor, str] | None:
    """(its values [width], its words) where the one other operand holds a number per coordinate of the last axis,
    computed from the module's parameters alone (no input reaches it)."""
    from attnscope.usertrace.linearweights import parameters_read
    from attnscope.usertrace.record import render_op

    if len(others) != 1 or others[0][0] != "rec":
        return None
    record = records[others[0][1]]
    tensor = record.tensor
    if not tensor.is_floating_point() or tensor.numel() != width or width < 2 or tensor.shape[-1] != width:
        return None
    if not parameters_read(record.index, records, params):  # a parameter of the module's, and no input
        return None
    words = record.label if record.names else render_op(record.call, record.style, record.args,
                                                        lambda i: records[i].label)
    return tensor.detach().double().reshape(width), words


def apply(projections: Projections, gain: QueryGain) -> Projections | None:
    """`projections` with each head's rows of the query projection times the gain (row h·d_head + j times gain[j]);
    None where its rows are no whole number of heads of the gain's width."""
    from attnscope.usertrace import fused

    name, linear = projections.linears["q"]
    weight, bias = linear.weight.detach(), getattr(linear, "bias", None)
    width = int(gain.values.numel())
    if weight.shape[0] % width:
        return None
    factor = gain.values.to(weight.dtype).repeat(weight.shape[0] // width)  # [n_head·d_head]
    held = fused.Part(f"{name}·gain", weight * factor[:, None], bias.detach() * factor if bias is not None else None,
                      getattr(linear, "rows", None))
    return dataclasses.replace(projections, linears={**projections.linears, "q": (held.name, held)})


def note(gain: QueryGain, scaled: bool) -> str:
    """The convention, said."""
    shown = ", ".join(f"{float(v):.4g}" for v in gain.values[:4]) + (", ..." if gain.values.numel() > 4 else "")
    rest = "the reference scales by 1/√d_head as well, as your code does" if scaled else \
        "your code scales its scores by nothing more, and the reference by 1"
    return (f"your queries are multiplied by {gain.what} (line {gain.line}), a learned gain per coordinate of each "
            f"head ([{shown}], TimesFM's per-dimension scale): a convention of your module's, read as part of the "
            f"query projection, which the reference holds times it; {rest}")
