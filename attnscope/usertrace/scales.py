"""A ratio of the user's scores to the reference's, in words: the usual mistakes of scale named (√d_head missing,
d_head for √d_head, √d_feat for √d_head), and measured against the user's --scale where one was given (T5's 1).
diagnose.py's constant-ratio cause and experiments.py's scale entries both say a ratio through here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnscope.usertrace.diagnosis import Context


def explain_ratio(step: str, ratio: float, ctx: Context) -> str:
    """Name the ratio when it is a known mistake of scale, else say it as a factor (√n where it is one)."""
    big = ratio if abs(ratio) >= 1 else 1 / ratio
    size = "too large" if abs(ratio) > 1 else "too small"
    told = ctx.spec.scale if ctx.spec is not None and step == "scores" else None
    if told is not None:  # the reference's scale is the user's --scale, not 1/√d_head
        return _against_told(ratio, told, ctx, f"scores are {_factor(big)} times {size}")
    if step == "scores":
        d_name = "d_head" if ctx.kind == "module" else "d_K"
        d = ctx.sizes.get(d_name)
        known: list[tuple[float, str]] = []
        if ctx.kind == "module" and "n_head" in ctx.sizes:
            n = ctx.sizes["n_head"]
            known.append((1 / math.sqrt(n), f"scores are √{n} = √(d_feat / d_head) times too small: divided by "
                                            "√d_feat, not √d_head"))
        if d:
            known += [(math.sqrt(d), f"scores are {_root(d)} = √{d_name} times too large: not divided by "
                                     f"√{d_name} (where that is your model's, T5's, --scale 1 describes it)"),
                      (1 / math.sqrt(d), f"scores are {_root(d)} = √{d_name} times too small: divided by "
                                         f"{d_name} = {d}, not √{d_name}")]
        for value, text in known:
            if math.isclose(ratio, value, rel_tol=1e-3):
                return text
    scaled = "; where your scale is your model's, --scale gives the reference's" if step == "scores" else ""
    return f"{step} is {_factor(big)} times {size} (a constant ratio {ratio:.6g}: a scale differs{scaled})"


def _against_told(ratio: float, told: float, ctx: Context, head: str) -> str:
    """A ratio of the scores where --scale gave the reference's scale: the user's scale, named where it is one of
    the usual ones (1/√d_head, 1/d_head, 1/√d_feat, 1)."""
    mine = ratio * told
    d_name = "d_head" if ctx.kind == "module" else "d_K"
    d = ctx.sizes.get(d_name)
    usual = [(1.0, "not scaled")]
    if d:
        usual += [(1 / math.sqrt(d), f"divided by √{d_name} = {_root(d).split(' ')[-1]}"),
                  (1 / d, f"divided by {d_name} = {d}")]
    if ctx.kind == "module" and d and "n_head" in ctx.sizes:
        usual.append((1 / math.sqrt(d * ctx.sizes["n_head"]), "divided by √d_feat"))
    said = next((text for value, text in usual if math.isclose(mine, value, rel_tol=1e-3)), f"multiplied by {mine:.4g}")
    origin = ctx.spec.scale_from if ctx.spec is not None else None
    if origin is not None:  # read from the module's config (Gemma 2's query_pre_attn_scalar): its own, not a flag's
        return (f"{head}: your scores are {said}, where the reference's are multiplied by {origin}; scale by it (or "
                "give --scale where your model's scale is another)")
    ours = "not scaled (--scale 1, T5's)" if told == 1 else f"multiplied by --scale {told:g}"
    return (f"{head}: your scores are {said}, where the reference's are {ours} as --scale says; where yours is your "
            "model's scale, give it with --scale")


def _root(n: int) -> str:
    """√16 = 4, √8 ≈ 2.83."""
    root = math.isqrt(n)
    return f"√{n} = {root}" if root * root == n else f"√{n} ≈ {math.sqrt(n):.3g}"


def _factor(x: float) -> str:
    if not math.isfinite(x * x):  # a --scale of 1e300 against the code's: no root to name
        return f"{x:.4g}"
    square = round(x * x)
    if square > 1 and math.isclose(x * x, square, rel_tol=1e-4) and not math.isclose(x, round(x), rel_tol=1e-4):
        return f"√{square} ≈ {x:.4g}"
    return f"{x:.4g}"
