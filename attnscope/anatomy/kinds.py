"""What each layer's attention is, from a config alone: full, sliding or chunked, its positions (RoPE and its
parameters, NoPE, absolute, relative bias, ALiBi), qk-norm, sinks, softcap and MLA.

transformers 5.x writes `layer_types` into every config of a family with mixed layers; configs written by 4.4x
do not, and each family's config class derives them in its own way. Those rules are restated here, each
naming the config class whose `__post_init__` it follows. What lives only in a family's modeling code (Qwen3's
qk-norm, GPT-OSS's sinks, Cohere 2's NoPE global layers) is listed per model_type, from transformers 5.23.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from attnscope.anatomy.config import Settings

# qk-norm that the modeling code always applies (Qwen3Attention's q_norm, Olmo2Attention's over the projection).
QK_NORM = {"qwen3": "RMSNorm per head", "qwen3_moe": "RMSNorm per head", "qwen3_next": "RMSNorm per head",
           "gemma3_text": "RMSNorm per head", "gemma3n_text": "RMSNorm per head", "exaone4": "RMSNorm per head",
           "gemma4_text": "RMSNorm per head", "qwen3_5_text": "RMSNorm per head",
           "qwen3_5_moe_text": "RMSNorm per head",
           "olmo2": "RMSNorm over the projection", "olmo3": "RMSNorm over the projection",
           "olmoe": "RMSNorm over the projection"}
# qk-norm behind a config flag, and the norm the family then uses.
QK_NORM_FLAGS = {"llama4_text": "L2 per head", "cohere": "LayerNorm per head", "stablelm": "LayerNorm per head",
                 "persimmon": "LayerNorm per head", "phi": "LayerNorm per head", "glm4_moe": "RMSNorm per head",
                 "hunyuan_v1_dense": "RMSNorm per head", "hunyuan_v1_moe": "RMSNorm per head"}
SINKS = frozenset({"gpt_oss"})  # GptOssAttention.sinks: a learned logit per head in every layer
NOPE_ON_FULL = frozenset({"cohere2", "exaone4"})  # RoPE on the sliding layers only (Cohere2Attention)
ENCODERS = frozenset({"bert", "roberta", "xlm-roberta", "camembert", "distilbert", "electra", "albert", "deberta",
                      "deberta-v2", "mpnet", "modernbert", "ernie", "megatron-bert", "rembert", "roformer",
                      "nomic_bert", "esm", "xlm-roberta-xl", "data2vec-text", "ibert", "mobilebert",
                      "squeezebert", "convbert", "funnel", "luke", "xmod", "canine", "layoutlm", "markuplm"})
DECODERS = frozenset({"gpt2", "gemma", "gemma2", "gemma3_text", "gemma4_text", "bloom", "falcon", "mpt", "gpt_neo",
                      "gptj", "codegen", "gpt_neox", "gpt_neox_japanese", "llama", "mistral", "qwen2", "phi3",
                      "llama4_text", "internlm3", "doge", "qwen3_5_text", "qwen3_5_moe_text", "glm4v_text",
                      "glm4v_moe_text", "emu3_text_model", "qwen2_5_omni_text", "qwen3_omni_moe_text"})
ABSOLUTE = frozenset({"gpt2", "gpt_bigcode", "opt", "gpt_neo", "biogpt", "xglm", "bart", "mbart", "marian",
                      "pegasus", "m2m_100", "blenderbot", "blenderbot-small", "plbart", "nllb-moe", "whisper",
                      "bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "distilbert", "electra",
                      "albert", "ernie", "megatron-bert", "rembert", "data2vec-text", "ibert", "mobilebert",
                      "squeezebert", "convbert", "xmod", "layoutlm", "markuplm", "luke"})
ROTARY = frozenset({"gptj", "codegen", "gpt_neox", "gpt_neox_japanese", "falcon"})  # RoPE without rope fields
RELATIVE = frozenset({"t5", "mt5", "umt5", "longt5", "switch_transformers", "deberta", "deberta-v2", "mpnet"})
# RoPE types transformers ships (ROPE_INIT_FUNCTIONS and the default), and older names it still reads.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional", "axial")
ROPE_ALIASES = {"su": "longrope", "mrope": "default"}  # Phi3Config, Qwen2VLConfig
# use_bidirectional_attention "all": every layer both ways, the sliding window reaching W // 2 + 1 on each side
# (Gemma4TextConfig.__post_init__; Gemma4UnifiedTextConfig's the same)
BIDIRECTIONAL_ALL = frozenset({"gemma4_text", "gemma4_unified_text"})
LAYER_TYPES = {"full_attention": "full", "attention": "full", "global": "full", "sliding_attention": "sliding",
               "local": "sliding", "chunked_attention": "chunked", "indexed_attention": "indexed"}


@dataclass(frozen=True)
class Rope:
    type: str
    base: float
    fraction: float  # of the rotated part's head size (d_K), 1.0 for all of it
    rotated: int  # how many of each query's and key's numbers are rotated
    factor: float | None = None
    original_context: int | None = None


@dataclass(frozen=True)
class Mla:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


def layer_types(s: Settings, n_layers: int) -> list[str]:
    """transformers' layer type of each layer: the config's own `layer_types`, else as its class derives them."""
    given = s.str_list("layer_types", n_layers) if s.raw("layer_types") is not None else None
    if given is not None:
        return given
    kind = s.model_type
    if (hybrid := _hybrid_types(s, n_layers)) is not None:
        return hybrid
    window = sliding_window(s)
    use_window, first_sliding = s.raw("use_sliding_window"), s.raw("max_window_layers")  # read either way
    if kind == "modernbert":  # ModernBertConfig: global every n-th layer from layer 0
        glob = s.size("global_attn_every_n_layers", default=3, cap=1 << 40)
        return ["sliding_attention" if i % glob else "full_attention" for i in range(n_layers)]
    if kind == "llama4_text":  # Llama4TextConfig: chunked on the RoPE layers, full on the NoPE ones
        return ["chunked_attention" if rope else "full_attention" for rope in rope_layers(s, n_layers)]
    if kind == "smollm3":  # SmolLM3Config: sliding (if asked) only on NoPE layers
        on = bool(s.flag("use_sliding_window")) and window is not None
        return ["sliding_attention" if on and not rope else "full_attention" for rope in rope_layers(s, n_layers)]
    if window is None or use_window is False:
        if s.raw("attention_chunk_size") is not None:  # transformers' cache: a chunk size alone means chunked
            return ["chunked_attention"] * n_layers
        return ["full_attention"] * n_layers
    if first_sliding is not None:  # Qwen2Config, Qwen3Config: sliding from layer max_window_layers
        first = s.integer("max_window_layers", minimum=0)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    every: int | None = {"gemma2": 2, "gpt_oss": 2, "gemma3_text": 6, "cohere2": 4, "olmo3": 4, "exaone4": 4}.get(kind)
    pattern = s.raw("sliding_window_pattern", "_sliding_window_pattern")
    if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:  # EXAONE 4: "LLLG", L local, G global
        return ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(n_layers)]
    if pattern is not None:  # Gemma3TextConfig, Cohere2Config
        every = s.size("sliding_window_pattern", "_sliding_window_pattern", cap=1 << 40)
    if every is not None:  # every n-th layer full, counting from 1
        return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
    return ["sliding_attention"] * n_layers  # Mistral, Phi-3, Starcoder2: the window on every layer


def sliding_window(s: Settings) -> int | None:
    """The window of the sliding layers; 0 means none (Qwen2MoeConfig saves 0 when it is off). A window both
    ways is read as ModernBERT's, window // 2 keys on each side; Gemma 4 as an encoder's is `2 * reach` (`reach`)."""
    name = {"modernbert": "local_attention", "recurrent_gemma": "attention_window_size"}.get(s.model_type,
                                                                                           "sliding_window")
    window = s.optional_size(name, minimum=0, cap=1 << 40) or None
    return window if window is None or not encoder_all(s) else 2 * reach(window)


def encoder_all(s: Settings) -> bool:
    """Gemma 4 with `use_bidirectional_attention: "all"`, an encoder: Gemma4TextConfig.__post_init__ sets
    `is_causal = False`, so masking_utils builds every layer's mask both ways (create_causal_mask ->
    create_bidirectional_mask, create_sliding_window_causal_mask -> create_bidirectional_sliding_window_mask), and
    Gemma4Attention.is_causal is False. ("vision" is a causal text model whose image tokens see each other.)"""
    if s.model_type not in BIDIRECTIONAL_ALL or s.raw("use_bidirectional_attention") != "all":
        return False
    s.raw("is_causal")  # False, as __post_init__ set it (save_pretrained writes it): read, the same thing said
    return True


def reach(window: int) -> int:
    """How far a Gemma 4 encoder's sliding layer sees on each side: Gemma4TextConfig.__post_init__ turns
    config.json's sliding_window W into W // 2 + 1, and masking_utils' sliding_window_bidirectional_overlay lets a
    query see the keys |i - j| <= that (2·(W // 2 + 1) + 1 keys in the middle of a long input)."""
    return window // 2 + 1


def _hybrid_types(s: Settings, n_layers: int) -> list[str] | None:
    """Families mixing attention with recurrent (mamba, linear attention) layers, whose configs do not list
    `layer_types`: as their config classes derive them."""
    kind = s.model_type
    blocks = s.raw("layers_block_type")
    if isinstance(blocks, list) and len(blocks) == n_layers and all(isinstance(b, str) for b in blocks):
        legacy = {"mamba": "linear_attention", "attention": "full_attention"}  # NemotronH, Zamba2
        return [legacy.get(b) or b for b in blocks]
    if kind == "jamba":  # JambaConfig: attention where i % attn_layer_period == attn_layer_offset
        period, offset = s.size("attn_layer_period", default=8), s.integer("attn_layer_offset", default=4, minimum=0)
        return ["full_attention" if i % period == offset else "linear_attention" for i in range(n_layers)]
    if kind == "bamba":  # BambaConfig: attention on attn_layer_indices only
        indices = s.raw("attn_layer_indices") or []
        return ["full_attention" if i in indices else "linear_attention" for i in range(n_layers)]
    if kind == "recurrent_gemma":  # RecurrentGemmaConfig: block_types repeated, "attention" a local window
        blocks = s.raw("block_types") or ["recurrent", "recurrent", "attention"]
        if not isinstance(blocks, list) or not blocks:
            raise s._error(("block_types",), "must be a list of block types")
        return ["sliding_attention" if blocks[i % len(blocks)] == "attention" else "linear_attention"
                for i in range(n_layers)]
    if kind == "lfm2" and isinstance(s.raw("full_attn_idxs"), list):  # Lfm2Config: attention on full_attn_idxs
        return ["full_attention" if i in s.raw("full_attn_idxs") else "conv" for i in range(n_layers)]
    if kind == "falcon_h1":  # attention and mamba side by side in every layer
        return ["hybrid"] * n_layers
    if kind in ("mamba", "mamba2", "falcon_mamba", "rwkv"):
        return ["linear_attention"] * n_layers
    return _types_2026(s, n_layers)


def _types_2026(s: Settings, n_layers: int) -> list[str] | None:
    """The layer types of 2026's families where config.json does not list them, as their config classes derive
    them."""
    kind = s.model_type
    if kind in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):  # Qwen3NextConfig: every 4th layer full
        every = s.size("full_attention_interval", default=4, cap=1 << 40)
        return ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
    if kind == "kimi_linear":  # KimiLinearConfig: linear_attn_config's 1-indexed lists, else every 4th from 4
        extra = s.mapping("linear_attn_config") or {}
        full, kda = extra.get("full_attn_layers"), extra.get("kda_layers")
        if isinstance(full, list) and isinstance(kda, list):
            return ["full_attention" if i + 1 in full else "linear_attention" for i in range(n_layers)]
        return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers)]
    if kind in ("deepseek_v32", "glm_moe_dsa"):  # every layer sparse
        return ["indexed_attention"] * n_layers
    if kind == "deepseek_v4":  # DeepseekV4Config: compress_ratios (0, 4, 128), else HCA, HCA, then CSA/HCA
        ratios = s.raw("compress_ratios")
        named = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
        if isinstance(ratios, list) and len(ratios) >= n_layers and all(r in named for r in ratios[:n_layers]):
            return [named[r] for r in ratios[:n_layers]]
        return (["heavily_compressed_attention"] * min(n_layers, 2)
                + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                   for i in range(max(n_layers - 2, 0))])
    return None


HYBRIDS = frozenset({"jamba", "bamba", "recurrent_gemma", "lfm2", "falcon_h1", "mamba", "mamba2", "falcon_mamba",
                     "rwkv", "nemotron_h", "zamba2"})


def rope_layers(s: Settings, n_layers: int) -> list[bool]:
    """Llama 4 and SmolLM3: `no_rope_layers[i]` is 1 where layer i uses RoPE (sic), 0 for NoPE; absent or
    empty, every `no_rope_layer_interval`-th layer is NoPE (Llama4TextConfig)."""
    given = s.raw("no_rope_layers")
    if given:
        if not isinstance(given, list) or len(given) < n_layers or \
                not all(isinstance(v, (int, bool)) and v in (0, 1) for v in given[:n_layers]):
            raise s._error(("no_rope_layers",), f"must be a list of at least {n_layers} 0s and 1s (1: RoPE)")
        return [bool(v) for v in given[:n_layers]]
    every = s.size("no_rope_layer_interval", default=4, cap=1 << 40)
    return [(i + 1) % every != 0 for i in range(n_layers)]


def position(s: Settings, layer_type: str, nope: bool) -> tuple[str, Rope | None]:
    """The layer's positions: ("rope", Rope) or ("nope" | "absolute" | "relative" | "alibi" | "not rope", None)."""
    kind = s.model_type
    embedding, buckets = s.raw("position_embedding_type"), s.raw("relative_attention_num_buckets")  # read either way
    if kind == "bloom" or s.raw("alibi") is True or _mpt_alibi(s):
        return "alibi", None
    if nope:
        return "nope", None
    family_rope = s.family.get("rope", False) or kind in ROTARY
    rope_named = s.given("rope_parameters", "rope_scaling", "rope_theta", "rotary_emb_base", "partial_rotary_factor",
                         "rotary_pct", "rotary_dim") or embedding == "rotary"
    if family_rope or rope_named:
        return "rope", rope(s, layer_type)
    if kind in RELATIVE or buckets is not None or embedding in ("relative_key", "relative_key_query"):
        return "relative", None
    if kind in ABSOLUTE or embedding == "absolute":
        return "absolute", None
    return "not rope", None


def _mpt_alibi(s: Settings) -> bool:
    attn_config = s.raw("attn_config")
    return isinstance(attn_config, Mapping) and attn_config.get("alibi") is True


def rope(s: Settings, layer_type: str) -> Rope:
    """RoPE's type, base and rotated fraction for a layer of `layer_type`, from `rope_parameters` (5.x, flat or
    one dict per layer type, as Gemma 3's) or `rope_theta`/`rope_scaling` and the like (4.4x)."""
    params = _rope_params(s, layer_type)
    name = params.get("rope_type", params.get("type", "default"))
    if not isinstance(name, str):
        raise s._error(("rope_parameters",), f"has rope_type {name!r}; it must be a string")
    name = ROPE_ALIASES.get(name, name)
    if s.model_type == "phi3" and name == "yarn":  # Phi3Config reads its old "yarn" as longrope
        name = "longrope"
    if name not in ROPE_TYPES:
        raise s._error(("rope_parameters",), f"has rope_type '{name}', not a RoPE type anatomy knows "
                       f"({', '.join(ROPE_TYPES)})")
    base = params.get("rope_theta")
    if base is None:
        base = s.raw("rope_theta", "rotary_emb_base")
    if base is None:
        base = s.default_theta(layer_type)
    base = _positive(s, "rope_theta", base)
    d_rot = rotary_head_dim(s)
    fraction = params.get("partial_rotary_factor")
    if fraction is None:
        fraction = s.raw("partial_rotary_factor", "rotary_pct")
    if fraction is None and s.raw("rotary_dim") is not None:  # GPT-J: a number of dimensions
        fraction = s.size("rotary_dim") / max(d_rot, 1)
    fraction = 1.0 if fraction is None else _positive(s, "partial_rotary_factor", fraction)
    if fraction > 1:
        raise s._error(("partial_rotary_factor",), f"is {fraction}; it is a fraction of head_dim, at most 1")
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings", s.raw("original_max_position_embeddings"))
    return Rope(name, base, fraction, int(d_rot * fraction), None if factor is None else _positive(s, "factor", factor),
                original if isinstance(original, int) and not isinstance(original, bool) else None)


def _rope_params(s: Settings, layer_type: str) -> Mapping[str, Any]:
    own = s.own.get("rope_parameters")
    if own is None and not s.given("rope_scaling", "rope_theta", "rope_local_base_freq", "global_rope_theta"):
        own = s.family.get("rope_default")  # none named: what the class builds (GPT-OSS: yarn)
    if own is not None:
        if not isinstance(own, Mapping):
            raise s._error(("rope_parameters",), "must be an object")
        s.used.add("rope_parameters")
        nested = [key for key, value in own.items() if key in LAYER_TYPES and isinstance(value, Mapping)]
        if nested:  # one dict per layer type (Gemma 3, ModernBERT in 5.x)
            bad = [key for key in LAYER_TYPES if key in own and not isinstance(own[key], Mapping)]
            if bad:
                raise s._error(("rope_parameters",), f"has {bad[0]} {str(own[bad[0]])[:40]!r}; each layer type's "
                               "entry must be an object")
            found = own.get(layer_type) or own.get("full_attention") or {}
            return {**found, "rope_theta": found.get("rope_theta", s.default_theta(layer_type))}
        return own
    scaling = s.mapping("rope_scaling") or {}
    if s.model_type == "gemma3_text":  # Gemma3TextConfig: rope_theta and scaling global, rope_local_base_freq local
        if layer_type == "sliding_attention":
            return {"rope_theta": s.raw("rope_local_base_freq") or s.default_theta(layer_type)}
        return {**scaling, "rope_theta": s.raw("rope_theta") or s.default_theta(layer_type)}
    if s.model_type == "modernbert":  # ModernBertConfig: global_rope_theta, local_rope_theta, one scaling
        name = "local_rope_theta" if layer_type == "sliding_attention" else "global_rope_theta"
        return {**scaling, "rope_theta": s.raw(name) or s.default_theta(layer_type)}
    return scaling


def rotary_head_dim(s: Settings) -> int:
    """The head size RoPE's fraction applies to: MLA's qk_rope_head_dim, else the query/key head size."""
    if s.raw("kv_lora_rank") is not None:
        return s.size("qk_rope_head_dim", minimum=0)
    return head_dim(s)


def head_dim(s: Settings) -> int:
    """head_dim and its other names, else hidden_size // num_attention_heads, as the modeling code takes it."""
    # A head_dim of 0 in config.json is refused, not shown as the derived size; a class default of 0
    # (glm5_next_text's) means "derive it".
    if s.raw("head_dim", "d_kv", "kv_channels") or s.given("head_dim", "d_kv", "kv_channels"):
        return s.size("head_dim", "d_kv", "kv_channels")
    width, heads = s.size("hidden_size", "n_embd", "d_model"), s.size("num_attention_heads", "n_head", "num_heads")
    if width < heads:
        raise s._error(("hidden_size",), f"is {width}, fewer than the {heads} heads, and no head_dim is given")
    return width // heads


def kv_heads(s: Settings, n_head: int) -> int:
    """KV heads: num_key_value_heads and its other names; Falcon's and GPT-BigCode's multi_query means 1."""
    named = s.raw("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")  # read either way
    if s.model_type == "falcon" and not s.raw("new_decoder_architecture") and s.raw("multi_query"):
        n_kv = 1
    elif s.model_type != "falcon" and s.raw("multi_query") is True:
        n_kv = 1
    else:
        n_kv = n_head if named is None else s.size("num_key_value_heads", "num_kv_heads", "n_kv_heads",
                                                   "multi_query_group_num")
    if n_head % n_kv:
        raise s._error(("num_key_value_heads",), f"is {n_kv}, which does not divide the {n_head} query heads")
    return n_kv


def qk_norm(s: Settings, rope_layer: bool) -> str | None:
    kind = s.model_type
    if kind in QK_NORM:
        return QK_NORM[kind]
    flag = s.raw("use_qk_norm", "qk_layernorm", "qk_norm")
    if flag is True or (isinstance(flag, str) and flag):
        if kind == "llama4_text" and not rope_layer:  # Llama4TextAttention: L2 norm on the RoPE layers only
            return None
        return QK_NORM_FLAGS.get(kind, "per config")
    return None


def mla(s: Settings) -> Mla | None:
    if s.raw("kv_lora_rank") is None:
        return None
    q_rank = s.optional_size("q_lora_rank")
    return Mla(q_rank, s.size("kv_lora_rank"), s.size("qk_nope_head_dim", minimum=0),
               s.size("qk_rope_head_dim", minimum=0), s.size("v_head_dim"))


def is_causal(s: Settings) -> bool | None:
    """Whether the model's own layers are causal: False for encoders (BERT, ModernBERT; Gemma 3 with
    use_bidirectional_attention, Gemma 4 with it "all"), None where nothing says (then a causal decoder is assumed,
    and said)."""
    kind = s.model_type
    if s.raw("use_bidirectional_attention") is True or encoder_all(s):
        return False
    if kind in ENCODERS:
        return s.raw("is_decoder") is True
    if kind in DECODERS or s.family.get("causal") is True:
        return True
    if s.family.get("causal") is False:
        return False
    return None


def _positive(s: Settings, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise s._error((name,), f"is {value!r}; it must be a positive number")
    return float(value)
