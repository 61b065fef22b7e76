"""The layers of 2026's families, from config.json alone, and what transformers' cache keeps for each: a sparse
indexer's keys beside an MLA cache (DeepSeek-V3.2, GLM-5), a linear attention layer's state of a fixed size
(Qwen3-Next, Qwen3.5, Kimi Linear), a KV cache another layer owns (Gemma 4), and DeepSeek-V4's compressed layers.

Each rule names the code it restates (transformers 5.23):
- indexed (`DynamicIndexedLayer`): the MLA cache, and `indexer_keys` `[n, index_head_dim]` a token, one head, where
  the layer runs its own indexer (GLM-5's `indexer_types` "shared" layers reuse the previous full layer's top-k and
  keep no keys); each query attends to its `index_topk` best keys.
- linear (`LinearAttentionLayer`): a conv state `[conv_dim, linear_conv_kernel_dim]` in the model's dtype (the last
  kernel-size inputs of the short convolution) and a recurrent state `[heads, d_k, d_v]`, float32 (the gated delta
  rule runs in float32: `torch_chunk_gated_delta_rule`, `chunk_kimi_delta_attention`), the same at any length.
- shared KV (Gemma 4's `kv_sharing_modes`): the layer's cache is `DummyLayer`, empty; its keys are its owner's.
- compressed (`DeepseekV4HCACache`, `DeepseekV4CSACache`): a sliding window of `sliding_window - 1` keys that are
  also the values (one KV head), one compressed entry of head_dim per `compress_rates[type]` tokens, the tokens
  since the last whole window (key and gate projections: 2 x head_dim each on an HCA layer, 2 x 2 x head_dim on a CSA
  layer, whose windows overlap), and on a CSA layer the previous window's overlap half and an indexer's own
  compressed keys, buffer and overlap (index_head_dim wide).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnscope.models.config import layer_entry

if TYPE_CHECKING:
    from attnscope.anatomy.config import Settings

LINEAR = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "kimi_linear", "minimax"})
INDEXED = frozenset({"deepseek_v32", "glm_moe_dsa"})
COMPRESSED = {"compressed_sparse_attention": "compressed_sparse", "heavily_compressed_attention": "heavily_compressed"}
V4_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}  # DeepseekV4Config's defaults
GLOBAL_HEAD_DIM = 512  # Gemma4TextConfig.__post_init__'s default global_head_dim


@dataclass(frozen=True)
class Indexer:
    """A sparse attention's lightning indexer: its heads, their size (the size of the key it caches a token) and how
    many keys each query keeps; `own` False where the layer reuses the previous layer's choice (GLM-5)."""

    n_heads: int
    head_dim: int
    topk: int
    own: bool = True


@dataclass(frozen=True)
class State:
    """A linear attention layer's recurrent state: `heads` matrices `[d_k, d_v]` (float32) and a short convolution's
    last `kernel` inputs over `conv_dim` channels (the model's dtype)."""

    kind: str  # "gated DeltaNet" (Qwen3-Next, Qwen3.5), "KDA" (Kimi Linear), "lightning" (MiniMax)
    heads: int
    d_k: int
    d_v: int
    conv_dim: int
    kernel: int
    float32: bool = True  # the recurrent state in float32 (the delta rules); MiniMax's in the model's dtype

    def bytes(self, bytes_per_number: int) -> int:
        return self.heads * self.d_k * self.d_v * (4 if self.float32 else bytes_per_number) \
            + self.conv_dim * self.kernel * bytes_per_number

    @property
    def flops_per_token(self) -> int:
        """One token's step: decay the state, read it with the key, correct it by the delta, read it with the
        query (about 7 d_k·d_v a head), whatever the number of tokens before; MiniMax's lightning step has no
        delta: decay, add kᵀv, read with the query (about 5 d_k·d_v)."""
        return self.heads * (5 if self.kind == "lightning" else 7) * self.d_k * self.d_v


@dataclass(frozen=True)
class Compress:
    """A DeepSeek-V4 layer: one compressed entry per `rate` tokens beside a sliding window, and on a CSA layer an
    indexer choosing the entries each query reads."""

    rate: int
    overlap: bool  # CSA: two series per token, windows that overlap by one
    indexer: Indexer | None
    rope_base: float | None = None  # compress_rope_theta: the compressed entries' RoPE base


def linear_state(s: Settings) -> State | None:
    """The state of the family's linear attention layers (None: a family whose linear layers anatomy does not read:
    Mamba, convolutions)."""
    if s.model_type not in LINEAR:
        return None
    if s.model_type == "minimax":  # MiniMaxLightningAttention: one [head_dim, head_dim] state a head, no convolution,
        heads = s.size("num_attention_heads")  # in the model's dtype (MiniMaxCache.linear_cache)
        d = s.optional_size("head_dim") or s.size("hidden_size") // heads
        return State("lightning", heads, d, d, 0, 0, float32=False)
    kernel = s.size("linear_conv_kernel_dim", default=4)
    if s.model_type == "kimi_linear":  # KimiDeltaAttention: q, k, v convolved, one [d, d] state a head
        extra = s.mapping("linear_attn_config") or {}
        heads = _int(extra.get("num_heads")) or s.size("linear_num_heads", default=32)
        d = _int(extra.get("head_dim")) or s.size("linear_head_dim", default=128)
        kernel = _int(extra.get("short_conv_kernel_size")) or kernel
        return State("KDA", heads, d, d, 3 * heads * d, kernel)
    n_k, n_v = s.size("linear_num_key_heads", default=16), s.size("linear_num_value_heads", default=32)
    d_k, d_v = s.size("linear_key_head_dim", default=128), s.size("linear_value_head_dim", default=128)
    return State("gated DeltaNet", n_v, d_k, d_v, 2 * n_k * d_k + n_v * d_v, kernel)  # conv over q, k and v


def indexers(s: Settings, n_layers: int) -> list[Indexer]:
    """Each layer's indexer: `index_n_heads`, `index_head_dim`, `index_topk`; GLM-5's `indexer_types` (or the
    pattern and schedule its config class derives them from) says which layers run their own."""
    heads, size = s.size("index_n_heads", default=64), s.size("index_head_dim", default=128)
    topk = s.size("index_topk", default=2048, cap=1 << 40)
    modes = ["full"] * n_layers
    if s.model_type == "glm_moe_dsa":  # GlmMoeDsaConfig.__post_init__
        given, pattern = s.raw("indexer_types"), s.raw("index_topk_pattern")
        if isinstance(given, list) and len(given) >= n_layers:
            modes = [str(m) for m in given[:n_layers]]
        elif isinstance(pattern, str) and len(pattern) >= n_layers:
            modes = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern[:n_layers]]
        else:
            freq = max(s.integer("index_topk_freq", default=1, minimum=1), 1)
            offset = s.integer("index_skip_topk_offset", default=2, minimum=0)
            modes = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]
    return [Indexer(heads, size, topk, mode != "shared") for mode in modes]


def kv_owners(s: Settings, types: list[str]) -> list[int | None]:
    """Gemma 4's `kv_sharing_modes`: the last `num_kv_shared_layers` layers each read the keys and values of the last
    earlier layer of their type (None: a layer with its own)."""
    shared = s.integer("num_kv_shared_layers", default=0, minimum=0) if s.model_type.startswith("gemma4") else 0
    first = len(types) - shared
    if shared == 0:
        return [None] * len(types)
    if first < 1:
        raise s._error(("num_kv_shared_layers",), f"is {shared}, leaving none of the {len(types)} layers to compute "
                       "keys and values")
    owners: list[int | None] = [None] * first
    for i in range(first, len(types)):
        found = [j for j in range(first) if types[j] == types[i]]
        if not found:
            raise s._error(("num_kv_shared_layers",), f"is {shared}: layer {i} ({types[i]}) has no earlier layer of "
                           "its type to share the cache of")
        owners.append(found[-1])
    return owners


def gemma4_sizes(s: Settings, index: int, layer_type: str, d_head: int, n_kv: int) -> tuple[int, int]:
    """(d_head, n_kv_head) of a Gemma 4 layer: `per_layer_config[index]`, else on a full layer `global_head_dim` and,
    with `attention_k_eq_v`, `num_global_key_value_heads` (`Gemma4TextConfig.__post_init__`)."""
    table = s.mapping("per_layer_config")
    if table is not None:
        own = layer_entry(table, index)
        if not isinstance(own, dict):
            raise s._error(("per_layer_config",), f"gives layer {index} {str(own)[:40]!r}; each entry must be an "
                           "object")
        d, n = own.get("head_dim", d_head), own.get("num_key_value_heads", n_kv)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (d, n)):
            raise s._error(("per_layer_config",), f"gives layer {index} head_dim {d!r} and num_key_value_heads "
                           f"{n!r}; both must be whole numbers of at least 1")
        return d, n
    if layer_type != "full_attention":
        return d_head, n_kv
    d = s.size("global_head_dim", default=GLOBAL_HEAD_DIM)
    if s.flag("attention_k_eq_v") and s.raw("num_global_key_value_heads") is not None:
        n_kv = s.size("num_global_key_value_heads")
    return d, n_kv


def compress(s: Settings, layer_type: str) -> Compress:
    """A DeepSeek-V4 layer's rate (`compress_rates`, or the older `compress_rate_csa` / `compress_rate_hca`)."""
    rates = s.mapping("compress_rates") or {}
    old = s.raw({"compressed_sparse_attention": "compress_rate_csa"}.get(layer_type, "compress_rate_hca"))
    rate = rates.get(layer_type, old if old is not None else V4_RATES[layer_type])
    if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
        raise s._error(("compress_rates",), f"gives {layer_type} the rate {rate!r}; it must be a whole number of at "
                       "least 1")
    s.raw("q_lora_rank", "qk_rope_head_dim")  # the query's low rank; the rotated share, read as the RoPE fraction
    base = s.optional_number("compress_rope_theta")
    if layer_type != "compressed_sparse_attention":
        return Compress(rate, False, None, base)
    return Compress(rate, True, Indexer(s.size("index_n_heads", default=64), s.size("index_head_dim", default=128),
                                        s.size("index_topk", default=512, cap=1 << 40)), base)


def compressed_numbers(c: Compress, window: int, d_head: int, n: int) -> int:
    """The numbers a V4 layer's cache holds after n tokens (`DeepseekV4HCACache`, `DeepseekV4CSACache`)."""
    series = 2 if c.overlap else 1
    entries, left = n // c.rate, n % c.rate
    held = min(n, window - 1) * d_head  # the sliding keys, which are the values
    held += entries * d_head + left * 2 * series * d_head  # compressed entries; the buffer's keys and gates
    if c.overlap and entries:
        held += 2 * c.rate * d_head  # the last window's first series (keys and gates), for the next overlap
    if c.indexer is not None:
        d = c.indexer.head_dim
        held += entries * d + left * 2 * series * d + (2 * c.rate * d if entries else 0)
    return held


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
