"""A learned gain on the values: modded-nanogpt's `v = self.lambdas[0] * v`, a scalar nn.Parameter of the module's
own multiplying the value projection's output on its way to the pattern.

Read from the data flow: walking up from the tensor the pattern multiplies (the values the attention reads) to the
projection that made it, each multiplication whose other operand is computed from the module's parameters alone and
holds one number is a gain. The reference's value projection holds it (its weight and bias times the gain), a
convention of the module's and a note; a number written in the code (`v * 0.5`) is no parameter, and no gain.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from attnscope.usertrace.record import MULTIPLIES

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Projections


@dataclasses.dataclass
class Gain:
    value: float
    what: str  # the code's words for it: lambdas[0]
    line: int


def find(records: list[Record], params: dict[str, Any]) -> Gain | None:
    """The product of the learned scalar gains on the values' way from their projection to the pattern; None where
    there is none (or the flow does not say which way the values came)."""
    from attnscope.usertrace import flow

    found = flow.operands(records)
    if found is None:
        return None
    read = gains_up(records, found[2], lambda record, others: _scalar(others, records, params))
    gains = [Gain(value, words, line) for value, words, line in read or ()]
    if not gains:
        return None
    total = math.prod(g.value for g in gains)
    return Gain(total, " · ".join(g.what for g in gains), gains[0].line)


def gains_up(records: list[Record], start: int, read: Callable[[Record, list[tuple[str, Any]]], Any]
             ) -> list[tuple[Any, str, int]] | None:
    """Walking up from record `start` to the projection (a Linear's call) it comes from, one input at a time, each
    multiplication `read` reads a gain in (given the record and its other operands; None: no gain), as (the gain, its
    words, its line); None where the way branches (two operands from the projections) or reaches no projection."""
    from attnscope.usertrace import flow

    made, from_linears = flow.linears_of(records)
    gains: list[tuple[Any, str, int]] = []
    index, seen = start, set()
    while index not in made and index not in seen:
        seen.add(index)
        record = records[index]
        given = [value for kind, value in record.args if kind == "rec"]
        path = [i for i in given if from_linears.get(i)]
        if len(path) != 1:
            return None
        if record.func in MULTIPLIES:
            found = read(record, [arg for arg in record.args if arg != ("rec", path[0])])
            if found is not None:
                gains.append((found[0], found[1], record.line))
        index = path[0]
    return gains if index in made else None


def _scalar(others: list[tuple[str, Any]], records: list[Record], params: dict[str, Any]) -> tuple[float, str] | None:
    """(its value, its words) where the one other operand holds one number computed from parameters alone."""
    from attnscope.usertrace.record import render_op
    from attnscope.usertrace.reference import parameters_read

    if len(others) != 1:
        return None
    kind, value = others[0]
    if kind == "text" and value in params and params[value].numel() == 1:
        return float(params[value].detach().reshape(())), str(value)
    if kind != "rec" or records[value].tensor.numel() != 1 or not records[value].tensor.is_floating_point():
        return None
    if not parameters_read(value, records, params):  # a parameter of the module's, and no input
        return None
    record = records[value]
    words = record.label if record.names else render_op(record.call, record.style, record.args,
                                                        lambda i: records[i].label)
    return float(record.tensor.reshape(())), words


def apply(projections: Projections, gain: Gain) -> Projections:
    """`projections` with the value projection times the gain, and the note that says so."""
    from attnscope.usertrace import fused

    name, linear = projections.linears["v"]
    bias = getattr(linear, "bias", None)
    held = fused.Part(f"{name}·{gain.what}", linear.weight.detach() * gain.value,
                      bias.detach() * gain.value if bias is not None else None, getattr(linear, "rows", None))
    said = (f"your values are multiplied by {gain.what} = {gain.value:.4g} (line {gain.line}), a learned gain of "
            "your module's own: read as part of the value projection, which the reference holds times it")
    return dataclasses.replace(projections, linears={**projections.linears, "v": (held.name, held)},
                               note=f"{projections.note}; {said}" if projections.note else said)
