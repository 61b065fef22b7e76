"""A clamp of the projections' output read from the code (DBRX's `qkv.clamp(min=-clip_qkv, max=clip_qkv)` where no
config says `clip_qkv`): a `clamp` (or `clip`) whose input is a projection's output, reshaped or cut at most. Its
bounds are read from the numbers, never from the op's text: where the clamp changed a value, what it wrote is the
bound on that side. A side it changed nothing on is the other side's mirror where that is consistent with the run
(nothing the clamp read lay beyond it), else open. None where the clamp changed nothing: the reference computes the
same numbers with or without it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Spec

CLAMPS = ("clamp", "clip", "clamp_", "clip_")
# what hands a projection's output on to the clamp unchanged in value (a fused output cut into q, k, v)
PASSING = ("view", "reshape", "split", "chunk", "unbind", "__getitem__", "contiguous", "transpose", "permute", "to",
           "type_as", "float")


def read(records: list[Record]) -> tuple[tuple[float, float], int] | None:
    """((min, max), the clamp's line) of the first clamp of a projection's output that changed a value."""
    for record in records:
        if record.func not in CLAMPS:
            continue
        given = [value for kind, value in record.args if kind == "rec"]
        if not given or not _from_projection(given[0], records):
            continue
        bounds = _bounds(records[given[0]], record)
        if bounds is not None:
            return bounds, record.line
    return None


def _from_projection(index: int, records: list[Record]) -> bool:
    while records[index].style != "linear":
        record = records[index]
        given = [value for kind, value in record.args if kind == "rec"]
        if record.func not in PASSING or len(given) != 1:
            return False
        index = given[0]
    return True


def _bounds(before: Record, after: Record) -> tuple[float, float] | None:
    x, y = before.tensor.double(), after.tensor.double()
    if x.shape != y.shape:
        return None
    changed = x != y
    if not bool(changed.any()):
        return None
    high_side, low_side = changed & (x > y), changed & (x < y)
    high = float(y[high_side].max()) if bool(high_side.any()) else None
    low = float(y[low_side].min()) if bool(low_side.any()) else None
    if high is not None and low is None:
        low = -high if float(x.min()) >= -high else -math.inf
    if low is not None and high is None:
        high = -low if float(x.max()) <= -low else math.inf
    assert low is not None and high is not None
    return (low, high) if low < high else None


def note(bounds: tuple[float, float], line: int) -> str:
    low, high = bounds
    said = f"±{high:g}" if low == -high else f"[{low:g}, {high:g}]"
    return (f"your code clips its projection's output to {said} (line {line}, read from the values it clamped; DBRX's "
            "clip_qkv): read as its own convention, the reference clips its Q_feat, K_feat and V_feat so")


# ops that end a normalization (an RMSNorm's rsqrt, F.rms_norm, F.layer_norm, F.normalize's norm)
NORMS = ("rsqrt", "rms_norm", "layer_norm", "normalize", "norm", "sqrt", "var", "std", "group_norm")
# ops that rotate (RoPE's tables, the complex form): a clamp past them sits after RoPE, not after the norm
TURNS = ("cos", "sin", "view_as_complex", "view_as_real", "polar")


def after_norm(records: list[Record]) -> int | None:
    """The line of the code's first clamp whose input is a norm's output rather than a projection's (HF OLMoE's
    `q_norm(q_proj(x)).clamp_(...)`): its input is no projection's output reshaped or cut, and what it is made of
    since the projection holds a normalization and no rotation. None where every clamp clips a projection's output
    (DBRX's, OLMo's order) or where no clamp sits after a norm."""
    for record in records:
        if record.func not in CLAMPS:
            continue
        given = [value for kind, value in record.args if kind == "rec"]
        if not given or _from_projection(given[0], records):
            continue
        made = _since_projection(given[0], records)
        if made & set(NORMS) and not made & set(TURNS):
            return record.line
    return None


def _since_projection(index: int, records: list[Record]) -> set[str]:
    """The ops `records[index]` is made of, back to (not past) the projections."""
    seen: set[int] = set()
    todo, funcs = [index], set()
    while todo:
        at = todo.pop()
        if at in seen or not 0 <= at < len(records):
            continue
        seen.add(at)
        record = records[at]
        if record.style == "linear":
            continue
        funcs.add(record.func)
        todo.extend(record.parents)
    return funcs


def placed(records: list[Record], spec: Spec) -> tuple[Spec, str | None]:
    """`spec` with q and k clipped after their qk-norm where the code's clamp sits there (after_norm), with the note
    that says so; as it was where the code clips the projections' output, or has no qk-norm before RoPE."""
    from dataclasses import replace

    if spec.clip_qkv is None or spec.qk_norm is None or spec.qk_norm_after:
        return spec, None
    line = after_norm(records)
    if line is None:
        return spec, None
    low, high = spec.clip_qkv
    said = f"±{high:g}" if low == -high else f"[{low:g}, {high:g}]"
    return replace(spec, clip_after_norm=True), (
        f"your code clips q and k to {said} after their qk-norm (line {line}: the clamp's input is the norm's "
        "output, HF OLMoE's order), v after its projection: read as its own convention, the reference clips its "
        "Q_normed and K_normed so, and V_feat")
