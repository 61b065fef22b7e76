"""`attnscope mask` between parsing and rendering: sizes, the mask file, the combined mask and its words."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attnscope.errors import UsageError
from attnscope.readings.maskview import MaskView, check_sizes, view

# One bool per (query, key), drawn and written as JSON: past this it is no longer something to look at.
MAX_CELLS = 4_000_000


@dataclass
class MaskOptions:
    nq: int = 8
    nk: int | None = None  # default --nq, or --cache + --nq
    causal: str | None = None
    window: int | None = None
    pad: int = 0
    cache: int = 0
    mask: str | None = None


def run_mask(o: MaskOptions) -> tuple[MaskView, dict[str, Any]]:
    if o.cache < 0 or o.pad < 0:
        raise UsageError("--cache and --pad count positions: they cannot be negative")
    n_K = (o.nq if o.nk is None else o.nk) if not o.cache else o.cache + o.nq
    if o.cache and o.nk is not None:
        check_sizes(o.nq, o.nk, o.cache)
    if o.cache and o.causal == "upper-left":
        raise UsageError(f"--cache {o.cache} puts the queries after {o.cache} cached positions, so causal aligns "
                         "lower-right; drop --causal upper-left")
    if o.nq * n_K > MAX_CELLS:
        raise UsageError(f"a {o.nq} x {n_K} mask has {o.nq * n_K:,} cells, more than the {MAX_CELLS:,} worth "
                         "drawing; the pattern repeats: ask for a smaller --nq/--nk (the rule is the same)")
    user = None
    if o.mask:
        from attnscope.tensors import load_tensor

        user = load_tensor(o.mask)
        if user.dim() == 0:
            raise UsageError(f"--mask {o.mask} is a single number; give a mask of shape [n_Q, n_K] or [n_K]")
    result = view(o.nq, n_K, causal=o.causal, window=o.window, pad=o.pad, user_mask=user, cache=o.cache)
    params = {"nq": o.nq, "nk": n_K, "causal": o.causal, "window": o.window, "pad": o.pad, "cache": o.cache,
              "mask": o.mask}
    return result, params
