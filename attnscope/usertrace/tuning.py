"""Llama 4's attention temperature tuning read as the module's own convention: where the module declares a
`floor_scale` and an `attn_scale` (Llama4TextConfig's names, on a config it keeps or was built with, or on itself;
`attn_temperature_tuning` not False), or Mistral 4's `original_max_position_embeddings` and `llama_4_scaling_beta`
(its rope_parameters'), and the reference without it diverges, the reference is run again with each query scaled
by `log1p(floor((p + 1) / floor_scale)) · attn_scale + 1` (variants/temperature.py), or by Mistral 4's
`get_llama_4_attn_scale`, which takes p itself, not p + 1: both are tried, by experiment. The reading is
kept only where that run lines up further (ranking.better_fit, its divergence placed in the first run's steps):
Llama 4's RoPE layers, which declare the same numbers and do not tune, stay as they were.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from attnscope.usertrace import declared

if TYPE_CHECKING:
    from attnscope.usertrace.lined import LineUp
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Spec


# the names a config gives the step of positions and the strength: Llama 4's; Mistral 4's (its rope_parameters')
NAMES = (("floor_scale", "attn_scale"), ("original_max_position_embeddings", "llama_4_scaling_beta"))


def declared_tuning(module: Any, built_with: dict[str, Any] | None) -> Any:
    """The TemperatureTuning the module declares (the position shifted by 1, as Llama 4 does), with the names it
    declares it under; None where it declares none (or turns it off)."""
    from attnscope.variants.temperature import TemperatureTuning

    if any(held.get("attn_temperature_tuning") is False for _, held in declared.holders(module, built_with)):
        return None
    for names in NAMES:
        floor = declared.own_value(module, names[:1], built_with)
        scale = declared.own_value(module, names[1:], built_with)
        if floor is not None and scale is not None:
            return TemperatureTuning(floor_scale=floor[1], attn_scale=scale[1]), names
    return None


def read(module: Any, shapes: Any, inputs: Any, records: list[Record], train: bool, spec: Spec,
         lined: LineUp) -> tuple[Spec, LineUp] | None:
    """(spec with the module's temperature tuning, its line-up, a note added) where it lines up further; else None."""
    from attnscope.usertrace.ranking import better_fit, named

    if lined.divergence is None or spec.temperature is not None:
        return None
    found = declared_tuning(module, spec.built_with)
    if found is None:
        return None
    best = None
    # the tuned reference holds steps of its own (attn_scales, the tuned queries): placed in the first run's steps
    steps = [row.reference for row in lined.rows]
    for asked, again in _tuned_runs(module, shapes, inputs, records, train, spec, found[0]):
        if better_fit(again, best[1] if best else lined, steps=steps, grade=named):
            best = asked, again
    if best is None:
        return None
    tuning, (floor, strength) = best[0].temperature, found[1]
    position = "(i + 1)" if tuning.shift else "i"
    best[1].notes.append(f"your code scales each query by log1p(floor({position} / {tuning.floor_scale:g})) · "
                         f"{tuning.attn_scale:g} + 1 at its position i (Llama 4's attention temperature tuning, its "
                         f"{floor} and {strength} read from your module): read as its own convention, and the "
                         "reference scales so too")
    return best


def tuned_queries(module: Any, shapes: Any, inputs: Any, records: list[Record], train: bool, spec: Spec) -> bool:
    """Whether some tensor of the code's is the queries tuned by the temperature the module declares (either shift):
    the code tunes its queries on these inputs, whatever follows."""
    from attnscope.usertrace.lined import ALIGNED

    found = declared_tuning(module, spec.built_with) if spec.temperature is None else None
    if found is None:
        return False
    return any(any(row.reference == "Q_tuned" and row.status in ALIGNED for row in again.rows)
               for _, again in _tuned_runs(module, shapes, inputs, records, train, spec, found[0]))


def _tuned_runs(module: Any, shapes: Any, inputs: Any, records: list[Record], train: bool, spec: Spec,
                tuning: Any) -> Iterator[tuple[Spec, LineUp]]:
    """(the spec tuned so, its line-up) with the position plus 1 (Llama 4), then as it is (Mistral 4): which one the
    code's numbers fit is read by experiment; a run that builds no reference is left out."""
    from attnscope.usertrace.relined import line_up_again

    for shift in (1, 0):
        asked = dataclasses.replace(spec, temperature=dataclasses.replace(tuning, shift=shift))
        again = line_up_again(module, shapes, inputs, records, train, asked)
        if again is not None:
            yield asked, again
