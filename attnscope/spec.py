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
upper-left unless said otherwise (Mistral's), unless `window_side` is "both": then the window is symmetric and there
is no causal mask (ModernBERT's local attention: query i sees key j when |i - j| <= window // 2, transformers'
`sliding_window_bidirectional_overlay` with `sliding_window = local_attention // 2`). Chunked attention (Llama 4)
implies causal too: query at position p sees key j when j <= p and both sit in the same chunk of `chunk` positions
(j // chunk == p // chunk). With cached positions the new queries come after them, so causal, window and chunks
align lower-right, as transformers' caches do, and an explicit upper-left is refused.

`sinks` says the attention has attention sinks (GPT-OSS): a learned logit per head joins each softmax row and is
dropped after. Their values are a parameter, not part of the spec: `sdpa(..., sinks=tensor)`, or the `sinks`
parameter a `MultiHeadAttention` owns (sinks.py).

Errors name the parameter (`window 0: ...`); the command line words them as flags (`--window 0: ...`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from attnscope.variants.qknorm import QkNorm
    from attnscope.variants.rope import Rope
    from attnscope.variants.temperature import TemperatureTuning

Align = Literal["upper-left", "lower-right"]
ALIGNMENTS: tuple[Align, ...] = ("upper-left", "lower-right")
WindowSide = Literal["left", "both"]
View = Literal["layer", "run", "mask"]  # who describes a spec in words (in_words)
WINDOW_SIDES: tuple[WindowSide, ...] = ("left", "both")


@dataclass(frozen=True)
class AttentionSpec:
    """The attention asked for. `causal` as given: False/None (bidirectional), True (causal: upper-left as
    `is_causal=True`, lower-right with a cache), or an alignment by name; `align` is the one in effect."""

    causal: bool | str | None = None
    window: int | None = None  # query at position p sees key j when j <= p and p - j < window
    alibi: bool = False  # BLOOM's per-head linear bias
    # ALiBi's slopes where they are not alibi.slopes(n_head) of the heads given: one head of a larger module
    # (MultiHeadAttention.head_inputs, a long input's blocks) keeps its own slope
    alibi_slopes: tuple[float, ...] | None = None
    softcap: float | None = None  # capped_scores = softcap * tanh(scores / softcap) (Gemma 2)
    rope: Rope | None = None  # rotary embeddings of Q and K
    scale: float | None = None  # None: 1/sqrt(d_K)
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: one per query head
    cache: int = 0  # cached positions before the new queries (a decode step)
    latent: Latent | None = None  # multi-head latent attention (DeepSeek-V2/V3): its sizes (latent.py)
    chunk: int | None = None  # query at position p sees key j when j <= p and j // chunk == p // chunk (Llama 4)
    temperature: TemperatureTuning | None = None  # Llama 4's per-query scale on its NoPE layers (temperature.py)
    sinks: bool = False  # attention sinks: a learned logit per head joins each softmax row (GPT-OSS; sinks.py)
    window_side: WindowSide = "left"  # "left": causal, keys at or before the query; "both": |i - j| <= window // 2
    # RMSNorm of Q and K before RoPE: "head" (over d_head, Qwen3) or "proj" (the whole projection, OLMo 2), or a
    # QkNorm (qknorm.py) that also says eps and Gemma's (1 + w); a word is made a QkNorm here
    qk_norm: QkNorm | str | None = None
    # the position of query 0 where the queries are rows start.. of a longer sequence whose keys are all given and
    # no causal alignment applies (a block of a long input's rows, forward/long.py); a causal block is a decode step
    # (`cache`) instead
    start: int = 0
    # q, k and v clipped after their projection, clamp(min, max) (DBRX's clip_qkv: (-c, c)); None: not clipped
    clip_qkv: tuple[float, float] | None = None
    # q and k clipped after their qk-norm rather than after their projection (HF OLMoE's order: the norms' output
    # clamped; v, which has no norm, after its projection still); only with clip_qkv and a qk-norm before RoPE
    clip_after_norm: bool = False
    # the values RMS-normed per head over d_V without weights, this eps (Gemma 3n's and Gemma 4's v_norm,
    # `v · (mean(v², -1) + eps)^-½`); None: the values as projected
    v_norm: float | None = None

    def __post_init__(self) -> None:
        if self.qk_norm is not None:
            from attnscope.variants.qknorm import QkNorm

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
        if self.clip_qkv is not None and not self.clip_qkv[0] < self.clip_qkv[1]:
            raise UsageError(f"{{clip_qkv}} {self.clip_qkv}: clip q, k and v to (min, max), min below max (either "
                             "may be infinite: open on that side)", "clip_qkv")
        if self.v_norm is not None and not (math.isfinite(self.v_norm) and self.v_norm >= 0):
            raise UsageError(f"{{v_norm}} {self.v_norm}: the values' norm takes an eps of 0 or more", "v_norm")
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
        if self.window_side not in WINDOW_SIDES:
            raise UsageError(f"{{window_side}} {self.window_side!r}: use 'left' (a causal window, Mistral's) or 'both' "
                             "(a symmetric one without a causal mask, ModernBERT's)", "window_side")
        if self.window_side == "both":
            self._check_bidirectional_window()
        if self.start < 0:
            raise UsageError(f"{{start}} {self.start}: the first query's position cannot be negative", "start")
        if self.start and self.align is not None:
            raise UsageError(f"{{start}} {self.start} places bidirectional queries; a causal block of rows is a "
                             "decode step after its earlier positions: give {cache} instead", "start", "cache")
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
        if not self.causal and self.chunk is None and (self.window is None or self.bidirectional_window):
            return None
        if self.cache:
            return "lower-right"
        return self.causal if self.causal in ALIGNMENTS else "upper-left"  # type: ignore[return-value]

    def offset(self, n_Q: int, n_K: int) -> int:
        """The position of query 0: 0 upper-left, n_K - n_Q lower-right, `start` without a causal mask."""
        return n_K - n_Q if self.align == "lower-right" else self.start

    @property
    def structural(self) -> bool:
        """Whether the attention builds a causal, window or chunk mask of its own, one bool per (query, key)."""
        return self.align is not None or self.window is not None

    @property
    def plain_causal(self) -> bool:
        """Causal and nothing else to the structural mask: where n_Q = n_K, `is_causal=True` says all of it."""
        return self.align is not None and self.window is None and self.chunk is None

    def with_cache(self, cache: int) -> AttentionSpec:
        """The same attention as a decode step after `cache` positions (checked again: upper-left is refused)."""
        return replace(self, cache=cache)

    def rows_from(self, start: int) -> AttentionSpec:
        """Rows start.. of a longer sequence's queries over all its keys: a causal attention's block is a decode
        step after `start` positions (its keys 0..the block's last are the caller's to give), any other's
        queries sit at positions start.. (a window on both sides is centred there)."""
        return self.with_cache(start) if self.align is not None else replace(self, start=start)

    # --- the spec as a stage hands it on: each edit named here, so no caller edits a spec by hand ----------

    def with_kv_heads(self, n_kv_head: int | None) -> AttentionSpec:
        """The same attention over `n_kv_head` key/value heads (a model layer's, from its config)."""
        return replace(self, n_kv_head=n_kv_head)

    def with_sinks(self) -> AttentionSpec:
        """The same attention with a sink logit per head (sinks.py: values given make it one)."""
        return replace(self, sinks=True)

    def with_latent(self, latent: Latent) -> AttentionSpec:
        """The same attention as multi-head latent attention of `latent`'s sizes (DeepSeek's MLA)."""
        return replace(self, latent=latent)

    def masked_by_caller(self) -> AttentionSpec:
        """What is left where the caller's mask holds the causal rule and the window (Gemma 3's image mask)."""
        return replace(self, causal=False, window=None)

    def after_stages(self) -> AttentionSpec:
        """What is left for the scores once a module's stages have run on Q and K: normed, rotated and tuned (the
        module's qk-norm, RoPE and temperature are applied before the cache joins)."""
        return replace(self, rope=None, temperature=None, qk_norm=None, clip_qkv=None)

    def after_norm(self) -> AttentionSpec:
        """What is left once Q and K are normed by a module's own weights (the float64 reference's, which rotates)."""
        return replace(self, qk_norm=None)

    def after_latent(self) -> AttentionSpec:
        """What is left for the scores once MLA's heads are made: the rotary parts rotated, the latent expanded
        into every head's keys and values, the queries tuned (a temperature)."""
        return replace(self, rope=None, latent=None, temperature=None)

    def one_head(self, alibi_slope: float | None = None) -> AttentionSpec:
        """One query head over its own key/value head (no grouping left), keeping its own ALiBi slope where the
        attention has ALiBi (one head of n_head: not a one-head module's slope)."""
        one = replace(self, n_kv_head=None)
        return one if alibi_slope is None else replace(one, alibi_slopes=(alibi_slope,))

    def without_structure(self) -> AttentionSpec:
        """The attention with no causal rule, window or chunk, no cache and no grouping: what a block of query rows
        computes where its structural mask and its repeated keys are handed in (rows.py)."""
        return replace(self, causal=None, window=None, chunk=None, window_side="left", cache=0, n_kv_head=None)

    def describe(self, d_head: int) -> str:
        """A model layer's attention in words, for the head view: `causal, RoPE (base 10000), scale 1/√64`."""
        return ", ".join(in_words(self, "layer", d_head=d_head))

    @property
    def reach(self) -> int:
        """How far a bidirectional window sees on each side: window // 2 (ModernBERT's `sliding_window`)."""
        return (self.window or 0) // 2

    @property
    def norm(self) -> QkNorm | None:
        """The qk-norm, typed (`qk_norm` is always a QkNorm or None once built)."""
        return self.qk_norm  # type: ignore[return-value]


def in_words(spec: AttentionSpec, view: View, *, d_head: int = 0, n_Q: int = 0, n_K: int = 0,
             given: list[str] | None = None) -> list[str]:
    """The attention `spec` asks for, in words, a phrase for each part in play: the one description of a spec,
    each view's wording side by side. "layer": a model layer's header (`AttentionSpec.describe`); "run": the
    header of an sdpa or mha run, the alignment spelled out for n_Q queries over n_K keys (runs/outputs.py);
    "mask": what masks, for the mask view (readings/maskview.py). `given`: what lies outside the spec (padded
    keys, a mask file, a position bias), said where the view says it."""
    given = given or []
    if view == "mask":
        if spec.bidirectional_window:
            masking = [f"bidirectional sliding window of {spec.window} (|i − j| ≤ {spec.reach})"]
        elif spec.window is not None:
            masking = [f"sliding window of {spec.window} ({spec.align})"]
        elif spec.chunk is not None:
            masking = [f"causal chunks of {spec.chunk} ({spec.align}): a query sees the earlier keys of its "
                       "own chunk"]
        else:
            masking = [f"causal ({spec.align})"] if spec.align else []
        sinks = ["attention sinks (not a mask: one more column per row, outside the grid)"] if spec.sinks else []
        return (masking + given or ["nothing: every key is seen"]) + sinks
    layer = view == "layer"
    parts = []
    if layer:
        parts.append("causal" if spec.align else "bidirectional (no causal mask)")
    elif spec.align:
        offset = spec.offset(n_Q, n_K)
        shift = f" + {offset}" if offset > 0 else f" − {-offset}" if offset < 0 else ""
        parts.append(f"causal {spec.align} (query i sees keys j ≤ i{shift})")
    if layer and spec.rope is not None:
        parts.append(f"RoPE ({spec.rope.describe()})")
    sliding = "sliding " if layer else ""
    if spec.bidirectional_window:
        parts.append(f"{sliding}window {spec.window} both sides (|i − j| ≤ {spec.reach}"
                     + (")" if layer else ", no causal mask)"))
    elif spec.window is not None:
        parts.append(f"{sliding}window {spec.window}")
    if spec.chunk is not None:
        parts.append(f"chunks of {spec.chunk}")
    if not layer and spec.cache:
        parts.append(f"KV cache: {spec.cache} cached + {n_Q} new positions")
    if not layer and spec.rope is not None:
        parts.append(f"RoPE {spec.rope.describe()}")
    if spec.temperature is not None:
        parts.append(spec.temperature.describe())
    if layer:
        parts.append(f"scale {f'1/√{d_head}' if spec.scale is None else f'{spec.scale:.6g}'}")
    elif spec.alibi:
        parts.append("ALiBi")
    if spec.softcap is not None:
        parts.append(f"softcap {spec.softcap:g}")
    if spec.clip_qkv is not None:
        parts.append(clip_words(spec.clip_qkv))
    if layer and spec.latent is not None:
        parts.append(spec.latent.describe())
    if spec.sinks:
        parts.append("attention sinks (a learned logit per head)" if layer
                     else "attention sinks (rows sum to less than 1)")
    if spec.norm is not None:
        parts.append(spec.norm.describe() if layer
                     else f"qk-norm {'per head' if spec.norm.over == 'head' else 'over the projection'}")
    return parts + given


def clip_words(clip: tuple[float, float]) -> str:
    """q, k and v clipped to (min, max), in words: DBRX's ±clip_qkv."""
    low, high = clip
    return f"q, k, v clipped to ±{high:g}" if low == -high else f"q, k, v clipped to [{low:g}, {high:g}]"


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
    even then the odd ones, as transformers' `apply_rotary_pos_emb_interleave` does. `rotary=False`: the shared part
    is not turned at all (Kimi Linear's MLA layers, NoPE: no RoPE is given, and d_rope is the shared part's width)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = False
    rotary: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank"):
            value = getattr(self, name)
            if value is None and name == "q_lora_rank":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{{{name}}} {value!r}: it must be a whole number of at least 1", name)
        if self.qk_rope_head_dim % 2 and self.rotary:
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
        if spec.rope is None and self.rotary:
            raise UsageError("{latent} rotates its Q_pe and K_pe parts; give {rope}", "latent", "rope")
        if spec.rope is not None and not self.rotary:
            raise UsageError("{latent} with rotary=False turns no part (NoPE); drop {rope}", "latent", "rope")
        if spec.sinks:
            raise UsageError("{sinks} with {latent}: latent attention (DeepSeek-V2/V3) has no attention sinks, and "
                             "LatentAttention owns no sink values; drop one", "sinks", "latent")
        if spec.qk_norm is not None:
            raise UsageError("{qk_norm} with {latent}: latent attention (DeepSeek-V2/V3) norms its latents, not Q and "
                             "K before RoPE (its rotary parts turn inside the latent module); drop one", "qk_norm",
                             "latent")

    def cache_bytes(self, batch: int, n_K: int, itemsize: int) -> int:
        """What a cache of this layer holds for n_K positions: KV_latent and K_pe, `d_latent + d_rope` numbers per
        token, shared by every head (transformers 5's `DeepseekV3Attention` caches exactly these)."""
        return batch * n_K * (self.kv_lora_rank + self.qk_rope_head_dim) * itemsize

    def full_cache_bytes(self, batch: int, n_head: int, n_K: int, itemsize: int) -> int:
        """The same positions cached as full heads, every head's K_full and V (what transformers 4.x cached)."""
        return batch * n_head * n_K * (self.d_K + self.v_head_dim) * itemsize

    def describe(self) -> str:
        query = f"query latent {self.q_lora_rank}, " if self.q_lora_rank is not None else ""
        shared = "RoPE part" if self.rotary else "unturned shared part"
        return (f"MLA ({query}KV latent {self.kv_lora_rank} + {shared} {self.qk_rope_head_dim}; "
                f"d_K {self.d_K} = {self.qk_nope_head_dim} + {self.qk_rope_head_dim}, d_V {self.v_head_dim})")
