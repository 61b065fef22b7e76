"""`attnscope anatomy` against transformers itself: each family's config class (layer_types, heads, RoPE as it
standardizes them), its modeling code (qk-norm, sinks, NoPE, read off the built attention modules), an
independent formula for the KV cache, and the bytes a real DynamicCache holds after a forward. Configs written
as transformers 4.4x wrote them (rope_theta, rope_scaling, sliding_window_pattern, no layer_types) give the
same rows as the same config saved by transformers 5."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from attnscope.anatomy.read import read_anatomy
from attnscope.models.nopage.cache_names import cache_of

DECODER = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 16, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1,
           "eos_token_id": 2}
# name -> (config class, sizes, model class to read the modeling code from)
FAMILIES = {
    "qwen3": ("Qwen3Config", {**DECODER, "head_dim": 8, "num_hidden_layers": 4, "use_sliding_window": True,
                              "sliding_window": 6, "max_window_layers": 2}, "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", {**DECODER, "num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 4,
                              "max_window_layers": 1}, "Qwen2ForCausalLM"),
    "gemma2": ("Gemma2Config", {**DECODER, "hidden_size": 24, "head_dim": 16, "num_hidden_layers": 3,
                                "sliding_window": 4, "attn_logit_softcapping": 50.0}, "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", {**DECODER, "head_dim": 8, "num_hidden_layers": 5, "num_key_value_heads": 1,
                                         "sliding_window": 5, "sliding_window_pattern": 3,
                                         "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
                    "Gemma3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", {**DECODER, "head_dim": 8, "num_hidden_layers": 4, "sliding_window": 4,
                                 "num_local_experts": 4, "num_experts_per_tok": 2}, "GptOssForCausalLM"),
    "llama4_text": ("Llama4TextConfig", {**DECODER, "head_dim": 8, "num_hidden_layers": 4, "attention_chunk_size": 4,
                                         "intermediate_size_mlp": 32, "num_local_experts": 2,
                                         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 16}},
                    "Llama4ForCausalLM"),
    "smollm3": ("SmolLM3Config", {**DECODER, "num_hidden_layers": 4, "use_sliding_window": True,
                                  "sliding_window": 4}, "SmolLM3ForCausalLM"),
    "olmo2": ("Olmo2Config", {**DECODER, "num_hidden_layers": 2}, "Olmo2ForCausalLM"),
    "phi3": ("Phi3Config", {**DECODER, "num_hidden_layers": 2, "sliding_window": 8, "partial_rotary_factor": 0.5,
                            "original_max_position_embeddings": 32}, "Phi3ForCausalLM"),
    "mistral": ("MistralConfig", {**DECODER, "num_hidden_layers": 2, "sliding_window": 4}, "MistralForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", {**DECODER, "num_hidden_layers": 2, "num_key_value_heads": 4,
                                         "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 4,
                                         "qk_rope_head_dim": 4, "v_head_dim": 6, "n_routed_experts": 4,
                                         "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                                         "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
                    "DeepseekV3ForCausalLM"),
    "modernbert": ("ModernBertConfig", {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 16,
                                        "num_attention_heads": 4, "num_hidden_layers": 4, "local_attention": 8,
                                        "max_position_embeddings": 64, "global_attn_every_n_layers": 2},
                   "ModernBertModel"),
    "bert": ("BertConfig", {"vocab_size": 64, "hidden_size": 24, "intermediate_size": 16, "num_attention_heads": 4,
                            "num_hidden_layers": 2, "max_position_embeddings": 64}, "BertModel"),
    "gpt2": ("GPT2Config", {"vocab_size": 64, "n_embd": 24, "n_layer": 2, "n_head": 4, "n_positions": 64},
             "GPT2LMHeadModel"),
    # families attnscope has no page for
    "cohere2": ("Cohere2Config", {**DECODER, "num_hidden_layers": 4, "sliding_window": 4}, "Cohere2ForCausalLM"),
    "stablelm": ("StableLmConfig", {**DECODER, "num_hidden_layers": 2, "qk_layernorm": True,
                                    "partial_rotary_factor": 0.25}, "StableLmForCausalLM"),
    "exaone4": ("Exaone4Config", {**DECODER, "num_hidden_layers": 4, "sliding_window": 4,
                                  "sliding_window_pattern": 2}, "Exaone4ForCausalLM"),
}
KINDS = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}


def build_config(name: str):
    import transformers

    cls_name, sizes, _ = FAMILIES[name]
    return getattr(transformers, cls_name)(**sizes)


def saved(config, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    return folder


def attention_modules(model) -> list:
    """The attention module of each layer, in order, as the modeling code built them."""
    names = ("Attention", "SelfAttention")
    found = [m for m in model.modules() if type(m).__name__.endswith(names) and hasattr(m, "forward")]
    return [m for m in found if not any(m is not o and m in set(o.modules()) for o in found)]


def reference_rows(config, model) -> list[dict]:
    """What each layer is, from transformers' own config object and built modules (none of anatomy's code)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, _ = get_layer_types_and_kwargs(config)
    rows = []
    for i, attention in enumerate(attention_modules(model)):
        kind = KINDS[types[i]]
        uses_rope = bool(getattr(attention, "use_rope", True))
        if type(config).__name__ == "Cohere2Config":  # Cohere2Attention rotates only on its sliding layers
            uses_rope = attention.sliding_window is not None
        if type(config).__name__ == "Exaone4Config":  # Exaone4Attention: global NoPE beside sliding layers
            uses_rope = attention.sliding_window is None or attention.is_sliding
        params = config.rope_parameters or {}
        params = params.get(types[i], params) if types[i] in params else params
        rope = (params.get("rope_type"), params.get("rope_theta"), params.get("partial_rotary_factor", 1.0))
        n_head = config.num_attention_heads
        norms = ("q_norm", "q_layernorm", "qk_norm")
        rows.append({"kind": kind, "window": config.sliding_window if kind == "sliding" else None,
                     "chunk": getattr(config, "attention_chunk_size", None) if kind == "chunked" else None,
                     "n_head": n_head, "n_kv_head": getattr(config, "num_key_value_heads", None) or n_head,
                     "d_K": attention.head_dim if not hasattr(attention, "qk_head_dim") else attention.qk_head_dim,
                     "rope": rope if uses_rope and params else None,
                     "qk_norm": any(getattr(attention, n, None) is not None for n in norms),
                     "sinks": hasattr(attention, "sinks")})
    return rows


def anatomy_rows(folder: Path) -> list[dict]:
    rows = []
    for _, layer in read_anatomy(str(folder)).layers:
        rope = (layer.rope.type, layer.rope.base, layer.rope.fraction) if layer.rope else None
        rows.append({"kind": layer.attention, "window": layer.window, "chunk": layer.chunk, "n_head": layer.n_head,
                     "n_kv_head": layer.n_kv_head, "d_K": layer.d_K, "rope": rope, "qk_norm": bool(layer.qk_norm),
                     "sinks": layer.sinks})
    return rows


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in ("bert", "gpt2", "modernbert")])
def test_each_layer_as_transformers_builds_it(name, tmp_path):
    import transformers

    config = build_config(name)
    model = getattr(transformers, FAMILIES[name][2])(config)
    expected = reference_rows(config, model)
    assert len(expected) == config.num_hidden_layers
    assert anatomy_rows(saved(config, tmp_path)) == expected


def test_an_encoder_keeps_no_cache_and_sees_both_ways(tmp_path):
    """ModernBERT: its own layer_types, local layers bidirectional with local_attention // 2 on each side."""
    config = build_config("modernbert")
    anatomy = read_anatomy(str(saved(config, tmp_path)), tokens=40)
    kinds = [KINDS[t] for t in config.layer_types]
    assert [layer.attention for _, layer in anatomy.layers] == kinds
    for _, layer in anatomy.layers:
        sizes = anatomy.sizes(layer)
        assert (layer.stack, layer.causal, sizes.kv_cache_bytes) == ("encoder", False, 0)
        assert sizes.keys == (2 * (config.local_attention // 2) + 1 if layer.attention == "sliding" else 40)
        base = config.rope_parameters[[k for k, v in KINDS.items() if v == layer.attention][0]]["rope_theta"]
        assert layer.rope.base == base


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_absolute_positions_and_sizes(name, tmp_path):
    config = build_config(name)
    anatomy = read_anatomy(str(saved(config, tmp_path)))
    assert len(anatomy.layers) == config.num_hidden_layers
    for _, layer in anatomy.layers:
        assert (layer.position, layer.rope, layer.n_head) == ("absolute", None, config.num_attention_heads)
        assert layer.d_K == config.hidden_size // config.num_attention_heads
        assert layer.causal is (name == "gpt2")
    assert anatomy.tokens == config.max_position_embeddings


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoder_shows_encoder_decoder_and_cross_layers(name, tmp_path):
    import transformers

    if name == "t5":
        config = transformers.T5Config(d_model=32, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=3)
        n_enc, n_dec, heads, d = 2, 3, (4, 4), (8, 8)
    else:
        config = transformers.BartConfig(d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                                         decoder_attention_heads=2, max_position_embeddings=64)
        n_enc, n_dec, heads, d = 2, 3, (4, 2), (8, 16)
    anatomy = read_anatomy(str(saved(config, tmp_path)), tokens=10)
    stacks = [layer.stack for _, layer in anatomy.layers]
    assert stacks == ["encoder"] * n_enc + ["decoder"] * n_dec + ["cross"] * n_dec
    bytes_per = 4
    for _, layer in anatomy.layers:
        head_count, d_head = (heads[0], d[0]) if layer.stack == "encoder" else (heads[1], d[1])
        assert (layer.n_head, layer.d_K, layer.position != "rope") == (head_count, d_head, True)
        expected = 0 if layer.stack == "encoder" else 2 * head_count * d_head * 10 * bytes_per
        assert anatomy.sizes(layer).kv_cache_bytes == expected
    assert {layer.position for _, layer in anatomy.layers if layer.stack != "cross"} == \
        ({"relative"} if name == "t5" else {"absolute"})


# --- configs as transformers 4.4x wrote them --------------------------------------------------------------------

LEGACY = {  # what 4.4x's save_pretrained wrote: rope_theta and rope_scaling, no layer_types, no rope_parameters
    "qwen3": {"model_type": "qwen3", **DECODER, "head_dim": 8, "num_hidden_layers": 4, "rope_theta": 1000000.0,
              "rope_scaling": None, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 4},
    "qwen2": {"model_type": "qwen2", **DECODER, "num_hidden_layers": 3, "rope_theta": 1000000.0,
              "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    "gemma2": {"model_type": "gemma2", **DECODER, "head_dim": 16, "num_hidden_layers": 3, "sliding_window": 4,
               "rope_theta": 10000.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": {"model_type": "gemma3_text", **DECODER, "head_dim": 8, "num_hidden_layers": 7,
                    "sliding_window": 5, "sliding_window_pattern": 6, "rope_theta": 1000000.0,
                    "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    "gpt_oss": {"model_type": "gpt_oss", **DECODER, "head_dim": 8, "num_hidden_layers": 4, "sliding_window": 4,
                "rope_theta": 150000.0, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                         "beta_slow": 1.0, "truncate": False,
                                                         "original_max_position_embeddings": 4096}},
    "llama4_text": {"model_type": "llama4_text", **DECODER, "head_dim": 8, "num_hidden_layers": 8,
                    "attention_chunk_size": 4, "no_rope_layers": [], "rope_theta": 500000.0, "use_qk_norm": True,
                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    "smollm3": {"model_type": "smollm3", **DECODER, "num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0],
                "rope_theta": 5000000.0},
    "olmo2": {"model_type": "olmo2", **DECODER, "num_hidden_layers": 2, "rope_theta": 500000.0},
    "phi3": {"model_type": "phi3", **DECODER, "num_hidden_layers": 2, "sliding_window": 8, "rope_theta": 10000.0,
             "partial_rotary_factor": 0.75, "original_max_position_embeddings": 32,
             "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 3}},
    "mistral": {"model_type": "mistral", **DECODER, "num_hidden_layers": 2, "sliding_window": 4,
                "rope_theta": 1000000.0},
    "deepseek_v3": {"model_type": "deepseek_v3", **FAMILIES["deepseek_v3"][1], "rope_theta": 10000.0,
                    "rope_scaling": {"type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                                     "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16}},
    "modernbert": {"model_type": "modernbert", **FAMILIES["modernbert"][1], "global_rope_theta": 160000.0,
                   "local_rope_theta": 10000.0},
    "cohere2": {"model_type": "cohere2", **DECODER, "num_hidden_layers": 8, "sliding_window": 4,
                "sliding_window_pattern": 4, "rope_theta": 50000.0},
}


@pytest.mark.parametrize("name", sorted(LEGACY))
def test_a_config_written_by_4_4x_gives_the_same_rows(name, tmp_path):
    """The hand-written 4.4x config, and the same config read by transformers 5 and saved again (with its
    layer_types and rope_parameters): the same layers, the same sizes."""
    from transformers import AutoConfig

    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps(LEGACY[name]))
    new = saved(AutoConfig.from_pretrained(old), tmp_path / "new")
    assert "layer_types" not in LEGACY[name] and "rope_parameters" not in LEGACY[name]
    before, after = read_anatomy(str(old), tokens=50), read_anatomy(str(new), tokens=50)
    assert [layer for _, layer in before.layers] == [layer for _, layer in after.layers]
    assert before.totals() == after.totals()
    saved_types = json.loads((new / "config.json").read_text()).get("layer_types")
    if saved_types:
        assert [layer.attention for _, layer in before.layers] == [KINDS[t] for t in saved_types]


# --- KV cache bytes -----------------------------------------------------------------------------------------------


def formula_bytes(config, n: int, per_number: int) -> int:
    """The KV cache of a decoder after n tokens, written from the config object alone: a full layer keeps n
    tokens, a sliding one min(n, W - 1), a chunked one min(n, C - 1); K and V of every KV head, or MLA's latent."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, _ = get_layer_types_and_kwargs(config)
    total = 0
    for layer_type in types:
        kept = {"full_attention": n, "sliding_attention": min(n, (getattr(config, "sliding_window", 0) or 0) - 1),
                "chunked_attention": min(n, (getattr(config, "attention_chunk_size", 0) or 0) - 1)}[layer_type]
        if getattr(config, "kv_lora_rank", None):
            per_token = config.kv_lora_rank + config.qk_rope_head_dim
        else:
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            per_token = 2 * config.num_key_value_heads * head_dim
        total += kept * per_token * per_number
    return total


DECODERS = [n for n in FAMILIES if n not in ("bert", "gpt2", "modernbert")]


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize(("tokens", "dtype", "per_number"), [(3, "bfloat16", 2), (50, "float32", 4)])
def test_kv_cache_bytes_against_a_formula(name, tokens, dtype, per_number, tmp_path):
    config = build_config(name)
    anatomy = read_anatomy(str(saved(config, tmp_path)), tokens=tokens, dtype=dtype)
    assert anatomy.totals()["kv_cache_bytes"] == formula_bytes(config, tokens, per_number)


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss", "llama4_text", "deepseek_v3", "qwen3", "cohere2"])
def test_kv_cache_bytes_equal_a_real_dynamic_cache(name, tmp_path):
    """A tiny model's forward over 11 tokens (longer than every window and chunk): the bytes of the keys and
    values its DynamicCache holds are anatomy's total."""
    import transformers

    config = build_config(name)
    folder = saved(config, tmp_path)
    model = getattr(transformers, FAMILIES[name][2])(config).eval()
    with torch.no_grad():
        cache = cache_of(model(torch.arange(11)[None] % 64, use_cache=True))  # transformers 5.2x: out.cache
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert read_anatomy(str(folder), tokens=11, dtype="float32").totals()["kv_cache_bytes"] == held


def test_mla_keeps_the_latent_and_says_what_full_heads_would_take(tmp_path):
    config = build_config("deepseek_v3")
    anatomy = read_anatomy(str(saved(config, tmp_path)), tokens=10, dtype="float32")
    totals = anatomy.totals()
    assert totals["kv_cache_bytes"] == 2 * 10 * (8 + 4) * 4
    assert totals["kv_cache_bytes_full_heads"] == 2 * 10 * 4 * ((4 + 4) + 6) * 4
    layer = anatomy.layers[0][1]
    assert (layer.d_K, layer.d_V, layer.rope.rotated, layer.rope.fraction) == (8, 6, 4, 1.0)


def test_flops_per_token_count_the_keys_each_layer_sees(tmp_path):
    config = build_config("gemma3_text")  # sliding 5 and full layers, 4 heads of 8
    anatomy = read_anatomy(str(saved(config, tmp_path)), tokens=20)
    for _, layer in anatomy.layers:
        keys = 5 if layer.attention == "sliding" else 20
        assert anatomy.sizes(layer).flops_per_token == 4 * keys * (2 * 8 + 2 * 8 + 1 + 5)


def test_a_chunked_layer_sees_its_own_chunk(tmp_path):
    config = build_config("llama4_text")  # chunks of 4
    anatomy = read_anatomy(str(saved(config, tmp_path)), tokens=10)
    chunked = next(layer for _, layer in anatomy.layers if layer.attention == "chunked")
    assert anatomy.sizes(chunked).keys == (10 - 1) % 4 + 1 == 2
    assert anatomy.sizes(chunked).cached_tokens == 3


def test_rope_of_each_layer_type_as_transformers_standardizes_it(tmp_path):
    """Gemma 3: local layers at rope_local_base_freq without scaling, global ones at rope_theta, scaled."""
    from transformers import AutoConfig

    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LEGACY["gemma3_text"]))
    reference = AutoConfig.from_pretrained(folder).rope_parameters
    for _, layer in read_anatomy(str(folder)).layers:
        params = reference["sliding_attention" if layer.attention == "sliding" else "full_attention"]
        assert (layer.rope.type, layer.rope.base) == (params["rope_type"], params["rope_theta"])
        assert layer.rope.factor == params.get("factor")
    assert math.isclose(read_anatomy(str(folder)).layers[0][1].rope.base, 10000.0)


@pytest.mark.parametrize("text_config", [
    # as google/gemma-3-4b-it's config.json gives it: most settings left to Gemma3TextConfig's defaults
    {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
     "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
    {"hidden_size": 64, "num_hidden_layers": 3, "sliding_window": 4},  # and without its model_type
])
def test_the_text_part_of_a_multimodal_config_with_its_class_defaults(text_config, tmp_path):
    """Gemma 3: the text_config holds a few settings; the rest are Gemma3TextConfig's defaults, as transformers
    reads them (AutoConfig, with its class defaults and derived layer_types, is the reference)."""
    from transformers import AutoConfig

    folder = tmp_path / "gemma3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                    "model_type": "gemma3", "text_config": text_config,
                                                    "vision_config": {"model_type": "siglip_vision_model"},
                                                    "torch_dtype": "bfloat16"}))
    reference = AutoConfig.from_pretrained(folder).text_config
    anatomy = read_anatomy(str(folder))
    assert (anatomy.part, anatomy.model_type, anatomy.dtype) == ("text_config", "gemma3_text", "bfloat16")
    assert anatomy.tokens == reference.max_position_embeddings
    assert [layer.attention for _, layer in anatomy.layers] == [KINDS[t] for t in reference.layer_types]
    for _, layer in anatomy.layers:
        params = reference.rope_parameters["sliding_attention" if layer.attention == "sliding" else "full_attention"]
        assert (layer.n_head, layer.n_kv_head, layer.d_K) == (reference.num_attention_heads,
                                                              reference.num_key_value_heads, reference.head_dim)
        assert (layer.window or reference.sliding_window) == reference.sliding_window
        assert (layer.rope.type, layer.rope.base, layer.rope.factor) == (params["rope_type"], params["rope_theta"],
                                                                          params.get("factor"))


@pytest.mark.parametrize(("cls_name", "sizes"), [
    ("JambaConfig", {"num_hidden_layers": 10, "attn_layer_period": 4, "attn_layer_offset": 1}),
    ("BambaConfig", {"num_hidden_layers": 6, "attn_layer_indices": [2, 5]}),
    ("RecurrentGemmaConfig", {"num_hidden_layers": 7, "attention_window_size": 16}),
    ("FalconH1Config", {"num_hidden_layers": 3}),  # Qwen3-Next's linear layers are read: test_anatomy_2026.py
    ("Mamba2Config", {"num_hidden_layers": 3}),
])
def test_layers_that_are_not_attention_are_named_and_not_counted(cls_name, sizes, tmp_path):
    """Families mixing attention with recurrent layers: the config saves only what its class derives
    layer_types from (attn_layer_period, block_types, ...); anatomy derives the same."""
    import transformers

    config = getattr(transformers, cls_name)(**sizes)
    anatomy = read_anatomy(str(saved(config, tmp_path)), tokens=32)
    assert [layer.attention for _, layer in anatomy.layers] == [KINDS.get(t, t) for t in config.layer_types]
    for _, layer in anatomy.layers:
        counted = anatomy.sizes(layer).kv_cache_bytes is not None
        assert counted == (layer.attention in ("full", "sliding", "chunked"))
        if layer.attention == "sliding":
            assert layer.window == config.attention_window_size
    assert anatomy.totals()["layers_not_counted"] == sum(t not in KINDS for t in config.layer_types)
