"""What attention was asked for: one typed value, built and validated once, then handed down.

`AttentionSpec` holds everything that shapes an attention besides its inputs, weights and masks given as data
(a mask file, key padding): the causal alignment, a sliding window, ALiBi, softcapping, RoPE, the scores' scale,
the key/value heads, and the cached positions before the new queries. `sdpa()`, `MultiHeadAttention`, the --check
reference (check.py), the mask grid and its translations (readings/) and the cost model (cost.py) read it; none of
them re-derives the alignment or re-checks an option. (x-transformers' `Attend(...)` and transformers'
config-driven attention keep the same habit.)

Alignment (masks.py): query i sits at position `i + offset`, key j at j. Upper-left has offset 0
(`is_causal=True`); lower-right has `offset = n_K - n_Q`, so the last query sees every key
(`torch.nn.attention.bias.causal_lower_right`, flash-attn's `causal=True`). A sliding window implies causal,
upper-left unless said otherwise (Mistral's), unless `window_side` is "both": then the window is symmetric and there
is no causal mask (ModernBERT's local attention: query i sees key j when |i - j| <= window // 2, transformers'
`sliding_window_bidirectional_overlay` with `sliding_window = local_attention // 2`). With cached positions the new
queries come after them, so causal and window align lower-right, as transformers' caches do, and an explicit
upper-left is refused.

`sinks` says the attention has attention sinks (GPT-OSS): a learned logit per head joins each softmax row and is
dropped after. Their values are a parameter, not part of the spec: `sdpa(..., sinks=tensor)`, or the `sinks`
parameter a `MultiHeadAttention` owns (sinks.py).

Errors name the parameter (`window 0: ...`); the command line words them as flags (`--window 0: ...`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from attnscope.rope import Rope

Align = Literal["upper-left", "lower-right"]
ALIGNMENTS: tuple[Align, ...] = ("upper-left", "lower-right")
WindowSide = Literal["left", "both"]
WINDOW_SIDES: tuple[WindowSide, ...] = ("left", "both")


@dataclass(frozen=True)
class AttentionSpec:
    """The attention asked for. `causal` as given: False/None (bidirectional), True (causal: upper-left as
    `is_causal=True`, lower-right with a cache), or an alignment by name; `align` is the one in effect."""

    causal: bool | str | None = None
    window: int | None = None  # query at position p sees key j when j <= p and p - j < window
    alibi: bool = False  # BLOOM's per-head linear bias
    softcap: float | None = None  # capped_scores = softcap * tanh(scores / softcap) (Gemma 2)
    rope: Rope | None = None  # rotary embeddings of Q and K
    scale: float | None = None  # None: 1/sqrt(d_K)
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: one per query head
    cache: int = 0  # cached positions before the new queries (a decode step)
    sinks: bool = False  # attention sinks: a learned logit per head joins each softmax row (GPT-OSS; sinks.py)
    window_side: WindowSide = "left"  # "left": causal, keys at or before the query; "both": |i - j| <= window // 2

    def __post_init__(self) -> None:
        if not (self.causal in (None, False, True) or self.causal in ALIGNMENTS):
            raise UsageError(f"{{causal}}={self.causal!r}: use True (upper-left), 'upper-left' or 'lower-right'",
                                 "causal")
        if self.window is not None and self.window < 1:
            raise UsageError(f"{{window}} {self.window}: a query must see at least itself, so the window is 1 "
                                 "or more", "window")
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise UsageError(f"{{softcap}} {self.softcap:g}: the cap must be a positive number (Gemma 2 uses 50)",
                                 "softcap")
        if self.scale is not None and not math.isfinite(self.scale):
            raise UsageError(f"{{scale}} {self.scale}: the scores' scale must be a finite number", "scale")
        if self.cache < 0:
            raise UsageError(f"{{cache}} {self.cache}: the number of cached positions cannot be negative",
                                 "cache")
        if self.n_kv_head is not None and self.n_kv_head < 1:
            raise UsageError(f"{{n_kv_head}} {self.n_kv_head}: there must be at least one key/value head",
                                 "n_kv_head")
        if self.window_side not in WINDOW_SIDES:
            raise UsageError(f"{{window_side}} {self.window_side!r}: use 'left' (a causal window, Mistral's) or 'both' "
                             "(a symmetric one without a causal mask, ModernBERT's)", "window_side")
        if self.window_side == "both":
            self._check_bidirectional_window()
        if self.cache and self.causal == "upper-left":
            raise UsageError(f"{{cache}} {self.cache} puts the queries after {self.cache} cached positions, so "
                                 "causal aligns lower-right; drop {causal} upper-left", "cache", "causal")

    def _check_bidirectional_window(self) -> None:
        if self.window is None:
            raise UsageError("{window_side} both says which way the window looks; give {window} too (ModernBERT's "
                             "local_attention, e.g. 128)", "window_side", "window")
        if self.causal or self.cache:
            given = "{cache} (a decode step, which is causal)" if self.cache else "{causal}"
            raise UsageError(f"{{window_side}} both is a symmetric window with no causal mask, so it cannot go with "
                             f"{given}; drop one, or use {{window_side}} left for a causal window",
                             "window_side", "cache" if self.cache else "causal")

    @property
    def bidirectional_window(self) -> bool:
        """A symmetric window and no causal mask (ModernBERT's local layers)."""
        return self.window is not None and self.window_side == "both"

    @property
    def align(self) -> Align | None:
        """The causal alignment in effect: None, upper-left or lower-right (None for a bidirectional window)."""
        if not self.causal and (self.window is None or self.bidirectional_window):
            return None
        if self.cache:
            return "lower-right"
        return self.causal if self.causal in ALIGNMENTS else "upper-left"  # type: ignore[return-value]

    def offset(self, n_Q: int, n_K: int) -> int:
        """The position of query 0: 0 upper-left (and without a causal mask), n_K - n_Q lower-right."""
        return n_K - n_Q if self.align == "lower-right" else 0

    @property
    def structural(self) -> bool:
        """Whether the attention builds a causal or window mask of its own, one bool per (query, key)."""
        return self.align is not None or self.window is not None

    def with_cache(self, cache: int) -> AttentionSpec:
        """The same attention as a decode step after `cache` positions (checked again: upper-left is refused)."""
        return replace(self, cache=cache)

    def describe(self, d_head: int) -> str:
        """A model layer's attention in words, for the head view: `causal, RoPE (base 10000), scale 1/√64`."""
        scale = f"1/√{d_head}" if self.scale is None else f"{self.scale:.6g}"
        parts = ["causal" if self.align else "bidirectional (no causal mask)"]
        if self.rope is not None:
            parts.append(f"RoPE ({self.rope.describe()})")
        if self.bidirectional_window:
            parts.append(f"sliding window {self.window} both sides (|i − j| ≤ {self.reach})")
        elif self.window is not None:
            parts.append(f"sliding window {self.window}")
        parts.append(f"scale {scale}")
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:g}")
        if self.sinks:
            parts.append("attention sinks (a learned logit per head)")
        return ", ".join(parts)

    @property
    def reach(self) -> int:
        """How far a bidirectional window sees on each side: window // 2 (ModernBERT's `sliding_window`)."""
        return (self.window or 0) // 2


def check_kv_heads(n_head: int, n_kv_head: int) -> None:
    """Grouped-query attention: every key/value head serves a whole group of query heads."""
    if n_head % n_kv_head:
        near = " or ".join(f"{{n_kv_head}} {h}" for h in divisors_near(n_head, n_kv_head))
        raise UsageError(f"{{n_head}} {n_head} is not a multiple of {{n_kv_head}} {n_kv_head}: each key/value "
                             f"head serves a whole group of query heads; try {near}", "n_head", "n_kv_head")


def divisors_near(d_feat: int, n_head: int) -> list[int]:
    """The head counts closest to `n_head` (one below, one above where they exist) that divide `d_feat`."""
    below = next((h for h in range(min(n_head, d_feat), 0, -1) if d_feat % h == 0), None)
    above = next((h for h in range(n_head + 1, d_feat + 1) if d_feat % h == 0), None)
    return [h for h in (below, above) if h is not None]
