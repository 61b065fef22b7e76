"""What attention was asked for: one typed value, built and validated once, then handed down.

`AttentionSpec` holds everything that shapes an attention besides its inputs, weights and masks given as data
(a mask file, key padding): the causal alignment, a sliding window, ALiBi, softcapping, RoPE, the scores' scale,
the key/value heads, the cached positions before the new queries, and the qk-norm (where it runs; its weights
belong to the module that owns them). `sdpa()`, `MultiHeadAttention`, the --check
reference (check.py), the mask grid and its translations (readings/) and the cost model (cost.py) read it; none of
them re-derives the alignment or re-checks an option. (x-transformers' `Attend(...)` and transformers'
config-driven attention keep the same habit.)

Alignment (masks.py): query i sits at position `i + offset`, key j at j. Upper-left has offset 0
(`is_causal=True`); lower-right has `offset = n_K - n_Q`, so the last query sees every key
(`torch.nn.attention.bias.causal_lower_right`, flash-attn's `causal=True`). A sliding window implies causal,
upper-left unless said otherwise (Mistral's). With cached positions the new queries come after them, so causal
and window align lower-right, as transformers' caches do, and an explicit upper-left is refused.

Errors name the parameter (`window 0: ...`); the command line words them as flags (`--window 0: ...`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from attnscope.qknorm import QkNorm
    from attnscope.rope import Rope

Align = Literal["upper-left", "lower-right"]
ALIGNMENTS: tuple[Align, ...] = ("upper-left", "lower-right")


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
    # RMSNorm of Q and K before RoPE: "head" (over d_head, Qwen3) or "proj" (the whole projection, OLMo 2), or a
    # QkNorm (qknorm.py) that also says eps and Gemma's (1 + w); a word is made a QkNorm here
    qk_norm: QkNorm | str | None = None

    def __post_init__(self) -> None:
        if self.qk_norm is not None:
            from attnscope.qknorm import QkNorm

            if isinstance(self.qk_norm, str):
                object.__setattr__(self, "qk_norm", QkNorm(self.qk_norm))
            elif not isinstance(self.qk_norm, QkNorm):
                raise UsageError(f"{{qk_norm}}={self.qk_norm!r}: use 'head', 'proj' or a QkNorm(...)", "qk_norm")
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
        if self.cache and self.causal == "upper-left":
            raise UsageError(f"{{cache}} {self.cache} puts the queries after {self.cache} cached positions, so "
                                 "causal aligns lower-right; drop {causal} upper-left", "cache", "causal")

    @property
    def align(self) -> Align | None:
        """The causal alignment in effect: None, upper-left or lower-right."""
        if not self.causal and self.window is None:
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
        return self.align is not None

    def with_cache(self, cache: int) -> AttentionSpec:
        """The same attention as a decode step after `cache` positions (checked again: upper-left is refused)."""
        return replace(self, cache=cache)

    def describe(self, d_head: int) -> str:
        """A model layer's attention in words, for the head view: `causal, RoPE (base 10000), scale 1/√64`."""
        scale = f"1/√{d_head}" if self.scale is None else f"{self.scale:.6g}"
        parts = ["causal" if self.align else "bidirectional (no causal mask)"]
        if self.rope is not None:
            parts.append(f"RoPE ({self.rope.describe()})")
        if self.window is not None:
            parts.append(f"sliding window {self.window}")
        parts.append(f"scale {scale}")
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:g}")
        if self.norm is not None:
            parts.append(self.norm.describe())
        return ", ".join(parts)

    @property
    def norm(self) -> QkNorm | None:
        """The qk-norm, typed (`qk_norm` is always a QkNorm or None once built)."""
        return self.qk_norm  # type: ignore[return-value]


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
