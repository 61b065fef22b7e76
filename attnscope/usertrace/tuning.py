"""Llama 4's attention temperature tuning read as the module's own convention: where the module declares a
`floor_scale` and an `attn_scale` (Llama4TextConfig's names, on a config it keeps or was built with, or on itself;
`attn_temperature_tuning` not False), and the reference without it diverges, the reference is run again with each
query scaled by `log1p(floor((p + 1) / floor_scale)) · attn_scale + 1` (variants/temperature.py). The reading is
kept only where that run lines up further (ranking.better_fit, its divergence placed in the first run's steps):
Llama 4's RoPE layers, which declare the same numbers and do not tune, stay as they were.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from attnscope.usertrace import declared

if TYPE_CHECKING:
    from attnscope.usertrace.lined import LineUp
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Spec


def declared_tuning(module: Any, built_with: dict[str, Any] | None) -> Any:
    """The TemperatureTuning the module declares, None where it declares none (or turns it off)."""
    from attnscope.variants.temperature import TemperatureTuning

    if any(held.get("attn_temperature_tuning") is False for _, held in declared.holders(module, built_with)):
        return None
    floor = declared.own_value(module, ("floor_scale",), built_with)
    scale = declared.own_value(module, ("attn_scale",), built_with)
    if floor is None or scale is None:
        return None
    return TemperatureTuning(floor_scale=floor[1], attn_scale=scale[1])


def read(module: Any, shapes: Any, inputs: Any, records: list[Record], train: bool, spec: Spec,
         lined: LineUp) -> tuple[Spec, LineUp] | None:
    """(spec with the module's temperature tuning, its line-up, a note added) where it lines up further; else None."""
    from attnscope.usertrace.ranking import better_fit, named
    from attnscope.usertrace.relined import line_up_again

    if lined.divergence is None or spec.temperature is not None:
        return None
    tuning = declared_tuning(module, spec.built_with)
    if tuning is None:
        return None
    asked = dataclasses.replace(spec, temperature=tuning)
    again = line_up_again(module, shapes, inputs, records, train, asked)
    # the tuned reference holds steps of its own (attn_scales, the tuned queries): placed in the first run's steps
    steps = [row.reference for row in lined.rows]
    if again is None or not better_fit(again, lined, steps=steps, grade=named):
        return None
    again.notes.append(f"your code scales each query by log1p(floor((i + 1) / {tuning.floor_scale:g})) · "
                       f"{tuning.attn_scale:g} + 1 at its position i (Llama 4's attention temperature tuning, its "
                       "floor_scale and attn_scale read from your module): read as its own convention, and the "
                       "reference scales so too")
    return asked, again
