"""`attnscope mask` between parsing and rendering: sizes, the mask file, the combined mask and its words."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attnscope.errors import UsageError
from attnscope.readings.maskview import MaskView, view
from attnscope.runs.options import check_cache_sizes, check_numbers, parse_sinks
from attnscope.spec import AttentionSpec

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
    chunk: int | None = None
    window_side: str = "left"
    sinks: str | None = None  # the values do not change the mask; the translations say where a library takes them


def run_mask(asked: MaskOptions) -> tuple[MaskView, dict[str, Any]]:
    check_numbers(asked)  # --mask '' and integers beyond 64 bits, refused as sdpa and mha refuse them
    if asked.cache < 0 or asked.pad < 0:
        raise UsageError("--cache and --pad count positions: they cannot be negative")
    n_K = (asked.nq if asked.nk is None else asked.nk) if not asked.cache else asked.cache + asked.nq
    if asked.cache and asked.nk is not None:
        check_cache_sizes(asked.nq, asked.nk, asked.cache)
    parse_sinks(asked.sinks)
    spec = AttentionSpec.asked(asked.causal, asked.window, asked.cache, chunk=asked.chunk,
                               window_side=asked.window_side, sinks=asked.sinks is not None)
    if asked.nq * n_K > MAX_CELLS:
        raise UsageError(f"a {asked.nq} x {n_K} mask has {asked.nq * n_K:,} cells, more than the {MAX_CELLS:,} worth "
                         "drawing; the pattern repeats: ask for a smaller --nq/--nk (the rule is the same)")
    user = None
    if asked.mask:
        from attnscope.tensors import load_tensor

        user = load_tensor(asked.mask)
        if user.dim() == 0:
            raise UsageError(f"--mask {asked.mask} is a single number; give a mask of shape [n_Q, n_K] or [n_K]")
    result = view(asked.nq, n_K, spec, pad=asked.pad, user_mask=user)
    params = {"nq": asked.nq, "nk": n_K, "causal": asked.causal, "window": asked.window, "pad": asked.pad,
              "cache": asked.cache, "mask": asked.mask, "chunk": asked.chunk,
              "window_side": asked.window_side if asked.window is not None else None, "sinks": asked.sinks}
    return result, params
