"""The line-up under another reading of the code (the code's own groups, its pooled tensors, a temperature, a
qk-norm): `line_up` run again, None where that reading cannot be run or holds no reference. Each reading then says
whether the line-up fits better (ranking.better_fit)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.lined import LineUp
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Spec


def line_up_again(module: Any, shapes: Any, inputs: Inputs, records: list[Record], train: bool,
                  spec: Spec) -> LineUp | None:
    """`line_up` under the reading (`inputs`, `records`, `spec` as the reading makes them); None where it raises a
    refusal or a torch error, or finds no reference."""
    from attnscope.errors import AttnscopeError
    from attnscope.usertrace.lineup import line_up

    try:
        again = line_up(module, shapes, inputs, records, train, spec)
    except (AttnscopeError, RuntimeError, ValueError):
        return None
    return again if again.no_reference is None else None
