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
upper-left unless said otherwise (Mistral's). Chunked attention (Llama 4) implies causal too: query at position p
sees key j when j <= p and both sit in the same chunk of `chunk` positions (j // chunk == p // chunk). With cached
positions the new queries come after them, so causal, window and chunks align lower-right, as transformers'
caches do, and an explicit upper-left is refused.

Errors name the parameter (`window 0: ...`); the command line words them as flags (`--window 0: ...`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from attnscope.rope import Rope
    from attnscope.temperature import TemperatureTuning

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
    latent: Latent | None = None  # multi-head latent attention (DeepSeek-V2/V3): its sizes (latent.py)
    chunk: int | None = None  # query at position p sees key j when j <= p and j // chunk == p // chunk (Llama 4)
    temperature: TemperatureTuning | None = None  # Llama 4's per-query scale on its NoPE layers (temperature.py)

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
        if self.latent is not None:
            self.latent.check_spec(self)
        if self.chunk is not None and self.chunk < 1:
            raise UsageError(f"{{chunk}} {self.chunk}: a chunk holds at least one position", "chunk")
        if self.chunk is not None and self.window is not None:
            raise UsageError(f"{{window}} {self.window} and {{chunk}} {self.chunk}: a layer has a sliding window or "
                             "chunks, not both (Llama 4's chunked layers have no window); drop one", "window", "chunk")
        if self.cache and self.causal == "upper-left":
            raise UsageError(f"{{cache}} {self.cache} puts the queries after {self.cache} cached positions, so "
                                 "causal aligns lower-right; drop {causal} upper-left", "cache", "causal")

    @classmethod
    def asked(cls, causal: bool | str | None, window: int | None = None, cache: int = 0,
              **variants: Any) -> AttentionSpec:
        """The attention a command line asks for with --causal, --window and --cache (and the other variants):
        a KV cache makes the run a decode step, which is causal, the new queries after the cached positions
        (lower-right), as transformers' caches are."""
        return cls(causal=causal or bool(cache), window=window, cache=cache, **variants)

    @property
    def align(self) -> Align | None:
        """The causal alignment in effect: None, upper-left or lower-right."""
        if not self.causal and self.window is None and self.chunk is None:
            return None
        if self.cache:
            return "lower-right"
        return self.causal if self.causal in ALIGNMENTS else "upper-left"  # type: ignore[return-value]

    def offset(self, n_Q: int, n_K: int) -> int:
        """The position of query 0: 0 upper-left (and without a causal mask), n_K - n_Q lower-right."""
        return n_K - n_Q if self.align == "lower-right" else 0

    @property
    def structural(self) -> bool:
        """Whether the attention builds a causal, window or chunk mask of its own, one bool per (query, key)."""
        return self.align is not None

    @property
    def plain_causal(self) -> bool:
        """Causal and nothing else to the structural mask: where n_Q = n_K, `is_causal=True` says all of it."""
        return self.align is not None and self.window is None and self.chunk is None

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
        if self.chunk is not None:
            parts.append(f"chunks of {self.chunk}")
        if self.temperature is not None:
            parts.append(self.temperature.describe())
        parts.append(f"scale {scale}")
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:g}")
        if self.latent is not None:
            parts.append(self.latent.describe())
        return ", ".join(parts)


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


@dataclass(frozen=True)
class Latent:
    """Multi-head latent attention's sizes (DeepSeek-V2/V3, transformers' `DeepseekV3Attention`), named as its
    config names them. Keys and values are made from one latent of `kv_lora_rank` numbers per token (d_latent,
    `KV_latent`, what a cache holds) and a rotary part of `qk_rope_head_dim` (d_rope, `K_pe`) shared by every
    head; each head's key is `qk_nope_head_dim` (d_nope, `K_nope`) expanded from the latent, then the rotary
    part: d_K = d_nope + d_rope; its value is `v_head_dim` (d_V). Queries go through a latent of
    `q_lora_rank` (d_Q_latent) when it is set, else one projection. `rope_interleave` (DeepSeek-V3's config
    flag): the rotary coordinates are stored as interleaved pairs and rotated half-split after gathering the
    even then the odd ones, as transformers' `apply_rotary_pos_emb_interleave` does."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = False

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank"):
            value = getattr(self, name)
            if value is None and name == "q_lora_rank":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{{{name}}} {value!r}: it must be a whole number of at least 1", name)
        if self.qk_rope_head_dim % 2:
            raise UsageError(f"{{qk_rope_head_dim}} {self.qk_rope_head_dim}: RoPE turns pairs of coordinates, so "
                             "the rotary part must be even (DeepSeek-V3 uses 64)", "qk_rope_head_dim")

    @property
    def d_K(self) -> int:
        """A head's query and key width: the no-RoPE part, then the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def check_spec(self, spec: AttentionSpec) -> None:
        """What latent attention cannot be asked together with."""
        if spec.n_kv_head is not None:
            raise UsageError(f"{{n_kv_head}} {spec.n_kv_head} with {{latent}}: latent attention expands a key and a "
                             "value for every head from one latent; drop {n_kv_head}", "n_kv_head", "latent")
        if spec.rope is None:
            raise UsageError("{latent} rotates its Q_pe and K_pe parts; give {rope}", "latent", "rope")

    def cache_bytes(self, batch: int, n_K: int, itemsize: int) -> int:
        """What a cache of this layer holds for n_K positions: KV_latent and K_pe, `d_latent + d_rope` numbers per
        token, shared by every head (transformers 5's `DeepseekV3Attention` caches exactly these)."""
        return batch * n_K * (self.kv_lora_rank + self.qk_rope_head_dim) * itemsize

    def full_cache_bytes(self, batch: int, n_head: int, n_K: int, itemsize: int) -> int:
        """The same positions cached as full heads, every head's K_full and V (what transformers 4.x cached)."""
        return batch * n_head * n_K * (self.d_K + self.v_head_dim) * itemsize

    def describe(self) -> str:
        query = f"query latent {self.q_lora_rank}, " if self.q_lora_rank is not None else ""
        return (f"MLA ({query}KV latent {self.kv_lora_rank} + RoPE part {self.qk_rope_head_dim}; "
                f"d_K {self.d_K} = {self.qk_nope_head_dim} + {self.qk_rope_head_dim}, d_V {self.v_head_dim})")
