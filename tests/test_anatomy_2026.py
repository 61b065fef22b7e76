"""`attnscope anatomy` on 2026's families against what transformers' own cache holds: each family's config class
saved by save_pretrained, read by anatomy from config.json alone, and the same config's model (weights drawn off
their init) run on N tokens with a `DynamicCache`, whose every tensor of every layer is summed (keys, values, an
indexer's keys, a linear layer's conv and recurrent states, DeepSeek-V4's compressed entries, buffers and overlaps;
a tensor two names share counted once). Layer by layer, the bytes anatomy says are the bytes the cache holds:
DeepSeek-V3.2 and GLM-5 (sparse indexed, GLM-5's shared indexer layers), Qwen3-Next and Qwen3.5 (gated DeltaNet),
Kimi Linear (KDA beside MLA), Gemma 4 (per-layer head sizes, K = V, shared KV) and DeepSeek-V4 (compressed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_main import run_main
from tiny_models import perturb

from attnscope.anatomy.read import read_anatomy
from attnscope.models.nopage.cache_names import cache_keyword
from attnscope.render.anatomy import anatomy_json

SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 16, "num_attention_heads": 4,
         "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
MLA = {"q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 6}
MOE = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "n_group": 1, "topk_group": 1}
INDEX = {"index_topk": 4, "index_head_dim": 8, "index_n_heads": 2}
LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 6,
          "linear_conv_kernel_dim": 3}
GEMMA4 = {**SMALL, "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 16, "num_global_key_value_heads": 1,
          "attention_k_eq_v": True, "sliding_window": 4, "hidden_size_per_layer_input": 4,
          "vocab_size_per_layer_input": 64}
# name -> (config class, sizes, model class)
FAMILIES = {
    "deepseek_v32": ("DeepseekV32Config", {**SMALL, "num_hidden_layers": 2, "num_key_value_heads": 4, **MLA, **MOE,
                                           **INDEX, "first_k_dense_replace": 1}, "DeepseekV32ForCausalLM"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", {**SMALL, "num_hidden_layers": 3, "num_key_value_heads": 4, **MLA, **MOE,
                                        **INDEX, "first_k_dense_replace": 1,
                                        "indexer_types": ["full", "shared", "full"]}, "GlmMoeDsaForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", {**SMALL, "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 8,
                                       **LINEAR, "num_experts": 4, "num_experts_per_tok": 2,
                                       "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8},
                   "Qwen3NextForCausalLM"),
    "qwen3_5_text": ("Qwen3_5TextConfig", {**SMALL, "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 8,
                                           **LINEAR}, "Qwen3_5ForCausalLM"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", {**SMALL, "num_hidden_layers": 4, "num_key_value_heads": 2,
                                                   "head_dim": 8, **LINEAR, "num_experts": 4, "num_experts_per_tok": 2,
                                                   "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8},
                         "Qwen3_5MoeForCausalLM"),
    "kimi_linear": ("KimiLinearConfig", {**SMALL, "num_hidden_layers": 3, "num_key_value_heads": 4, **MLA,
                                         "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 8,
                                         "linear_attn_config": {"num_heads": 2, "head_dim": 8,
                                                                "short_conv_kernel_size": 3, "full_attn_layers": [2],
                                                                "kda_layers": [1, 3]}},
                    "KimiLinearForCausalLM"),
    "gemma4_text": ("Gemma4TextConfig", {**GEMMA4, "num_hidden_layers": 6, "num_kv_shared_layers": 2,
                                         "layer_types": ["sliding_attention", "full_attention"] * 3},
                    "Gemma4ForCausalLM"),
    # 12 layers: per_layer_config's keys are written "01", "03", ...; four layers share two caches
    "gemma4_12": ("Gemma4TextConfig", {**GEMMA4, "num_hidden_layers": 12, "num_kv_shared_layers": 4,
                                       "layer_types": (["sliding_attention"] * 2 + ["full_attention"]) * 4},
                  "Gemma4ForCausalLM"),
    # the multimodal checkpoint: the text part read from text_config
    "gemma4": ("Gemma4Config", {"text_config": {**GEMMA4, "num_hidden_layers": 6, "num_kv_shared_layers": 2,
                                                "layer_types": ["sliding_attention", "full_attention"] * 3},
                                "vision_config": {"hidden_size": 16, "intermediate_size": 20, "num_hidden_layers": 1,
                                                  "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
                                                  "patch_size": 4, "position_embedding_size": 64},
                                "audio_config": None, "image_token_id": 63, "boi_token_id": 62, "eoi_token_id": 61,
                                "video_token_id": 60}, "Gemma4ForConditionalGeneration"),
    "deepseek_v4": ("DeepseekV4Config", {**SMALL, "num_hidden_layers": 4, "num_key_value_heads": 1, "head_dim": 16,
                                         "qk_rope_head_dim": 4, "q_lora_rank": 16, "o_lora_rank": 8, "o_groups": 2,
                                         "sliding_window": 4, **INDEX, "n_routed_experts": 4,
                                         "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                                         "compress_rates": {"compressed_sparse_attention": 2,
                                                            "heavily_compressed_attention": 4}},
                    "DeepseekV4ForCausalLM"),
}
TOKENS = 11  # past every window, top-k and compression rate above, not a multiple of any rate


def _config(name: str):
    import transformers

    cls_name, sizes, _ = FAMILIES[name]
    return getattr(transformers, cls_name)(**sizes)


def _held(layer) -> int:
    """Every tensor a cache layer holds, through dicts, each storage once (V4's values are its keys); not its private
    bookkeeping (a sliding layer's `_sliding_window_tensor`, the window as a number)."""
    seen: dict[int, int] = {}

    def visit(value) -> None:
        if isinstance(value, torch.Tensor) and value.numel():
            seen[value.untyped_storage().data_ptr()] = value.numel() * value.element_size()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)

    for name, value in vars(layer).items():
        if not name.startswith("_"):
            visit(value)
    return sum(seen.values())


def _cache_bytes(name: str, config) -> list[int]:
    """transformers' DynamicCache after a forward of TOKENS tokens: the bytes of each layer's cache."""
    import transformers
    from transformers import DynamicCache

    torch.manual_seed(0)
    model = perturb(getattr(transformers, FAMILIES[name][2])(config).eval())
    cache = DynamicCache(config=config)
    with torch.no_grad():
        model(input_ids=torch.arange(3, 3 + TOKENS)[None], **{cache_keyword(model): cache}, use_cache=True)
    return [_held(layer) for layer in cache.layers]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_kv_bytes_equal_the_cache_transformers_holds(name, tmp_path: Path):
    config = _config(name)
    config.save_pretrained(tmp_path)
    anatomy = read_anatomy(str(tmp_path), tokens=TOKENS)
    data = anatomy_json(anatomy)
    held = _cache_bytes(name, config)
    assert [layer["kv_cache_bytes"] for layer in data["layers"]] == held
    assert data["totals"]["kv_cache_bytes"] == sum(held)
    assert data["totals"]["layers_not_counted"] == 0


def test_what_each_layer_is(tmp_path: Path):
    """The kinds, sizes and owners as the config classes and modeling code have them."""
    import transformers

    rows = {}
    for name in ("glm_moe_dsa", "kimi_linear", "gemma4_12", "deepseek_v4"):
        config = _config(name)
        config.save_pretrained(tmp_path / name)
        rows[name] = (config, anatomy_json(read_anatomy(str(tmp_path / name), tokens=TOKENS))["layers"])
    config, layers = rows["glm_moe_dsa"]
    assert [layer["indexer"]["own"] for layer in layers] == [t == "full" for t in config.indexer_types]
    assert [layer["keys"] for layer in layers] == [min(TOKENS, config.index_topk)] * 3
    config, layers = rows["kimi_linear"]
    assert [layer["kind"] for layer in layers] == ["linear", "full", "linear"]
    assert layers[0]["state_bytes"] == layers[0]["kv_cache_bytes"]
    config, layers = rows["gemma4_12"]
    model = transformers.Gemma4ForCausalLM(config)
    modules = [layer.self_attn for layer in model.model.layers]
    assert [layer["head_dim"] for layer in layers] == [m.head_dim for m in modules]
    assert [layer["n_kv_head"] for layer in layers] == [4 // m.num_key_value_groups for m in modules]
    assert [layer["k_eq_v"] for layer in layers] == [m.use_alternative_attention for m in modules]
    reuse = [mode == "reuse" for mode in config.kv_sharing_modes]
    assert [layer["kv_shared_from"] is not None for layer in layers] == reuse
    modes, types = config.kv_sharing_modes, config.layer_types
    stores = [next(j for j, mode in enumerate(modes) if mode == "store" and types[j] == types[i]) for i in range(8, 12)]
    assert [layer["kv_shared_from"] for layer in layers[8:]] == stores == [5, 7, 7, 5]
    config, layers = rows["deepseek_v4"]
    assert [layer["kind"] for layer in layers] == [t.removesuffix("_attention") for t in config.layer_types]
    assert [layer["compress"]["rate"] for layer in layers] == [config.compress_rates[t] for t in config.layer_types]


def test_a_linear_layers_state_does_not_grow(tmp_path: Path):
    config = _config("qwen3_next")
    config.save_pretrained(tmp_path)
    short, long = (anatomy_json(read_anatomy(str(tmp_path), tokens=n))["layers"] for n in (10, 10_000))
    assert short[0]["kv_cache_bytes"] == long[0]["kv_cache_bytes"] > 0
    assert long[3]["kv_cache_bytes"] == 1000 * short[3]["kv_cache_bytes"]  # the full layer: every token


def test_the_command_says_it_in_words(tmp_path: Path):
    for name in ("deepseek_v32", "qwen3_5_text", "gemma4_text"):
        _config(name).save_pretrained(tmp_path / name)
    out = run_main("anatomy", str(tmp_path / "deepseek_v32"), "--tokens", "4096")
    assert out.code == 0, out.stderr
    assert "indexed top-4" in out.stdout and "indexer_keys" in out.stdout
    out = run_main("anatomy", str(tmp_path / "qwen3_5_text"), "--tokens", "4096")
    assert "linear (gated DeltaNet)" in out.stdout and "the same at any number of" in out.stdout
    out = run_main("anatomy", str(tmp_path / "gemma4_text"), "--tokens", "4096")
    assert "KV of layer 2" in out.stdout and "counted once" in out.stdout.replace("\n", " ") and "K = V" in out.stdout
    assert "not interpreted" not in out.stdout


@pytest.mark.parametrize("name", ["qwen3-next-defaults.json", "deepseek-v3.2-defaults.json", "gemma-4-shared-kv.json",
                                  "deepseek-v4-defaults.json"])
def test_tables_fit_80_columns_and_read_every_setting(name):
    from rich.cells import cell_len

    outcome = run_main("anatomy", str(Path(__file__).parent / "configs" / name), "--tokens", "131072")
    assert outcome.code == 0, outcome.stderr
    assert max(cell_len(line) for line in outcome.stdout.splitlines()) <= 80
    assert "not interpreted" not in outcome.stdout


@pytest.mark.parametrize("n", [3, 8, 11, 20])
def test_gemma4_as_an_encoder(tmp_path: Path, n):
    """use_bidirectional_attention "all": every layer both ways, read as transformers' masks have it. Each layer's
    `keys` (a token in the middle of N) is the number of keys the middle query's row of transformers' eager
    output_attentions gives weight (masking_utils' create_bidirectional_mask and
    create_bidirectional_sliding_window_mask, |i - j| <= sliding_window // 2 + 1); nothing cached; "vision" stays a
    causal decoder."""
    import transformers

    sizes = {**GEMMA4, "attention_k_eq_v": False, "num_hidden_layers": 4, "sliding_window": 6,
             "layer_types": ["sliding_attention", "full_attention"] * 2}
    config = transformers.Gemma4TextConfig(**sizes, use_bidirectional_attention="all")
    config.save_pretrained(tmp_path)
    data = anatomy_json(read_anatomy(str(tmp_path), tokens=n))
    layers = data["layers"]
    assert [layer["kind"] for layer in layers] == [t.removesuffix("_attention") for t in config.layer_types]
    assert all(not layer["causal"] and layer["stack"] == "encoder" and "bidirectional" in layer["label"]
               for layer in layers)
    reach = config.sliding_window  # 6 // 2 + 1, as Gemma4TextConfig.__post_init__ sets it
    assert reach == 4 and [layer["window"] for layer in layers] == [2 * reach, None] * 2
    assert [layer["kv_cache_bytes"] for layer in layers] == [0] * 4 and data["totals"]["kv_cache_bytes"] == 0
    torch.manual_seed(0)
    read = transformers.AutoConfig.from_pretrained(tmp_path)  # config.json read back: the window halved once more
    assert read.sliding_window == reach and read.is_causal is False
    model = perturb(transformers.Gemma4ForCausalLM._from_config(read, attn_implementation="eager").eval())
    with torch.no_grad():
        attentions = model(input_ids=torch.arange(3, 3 + n)[None], output_attentions=True).attentions
    seen = [int((a[0, :, n // 2] > 0).sum(-1).unique().item()) for a in attentions]  # the middle query, every head
    assert [layer["keys"] for layer in layers] == seen
    assert seen == [min(n, 2 * reach + 1), n] * 2  # the rule in words: reach keys each side, every key
    for layer in layers:
        width = 2 * layer["d_K"] + 2 * layer["d_V"] + 6
        assert layer["flops_per_token"] == layer["n_head"] * layer["keys"] * width
    if n == 20:
        out = run_main("anatomy", str(tmp_path), "--tokens", str(n))
        assert out.code == 0, out.stderr
        text = out.stdout.replace("\n", " ")
        assert "use_bidirectional_attention 'all'" in text and "|i - j| <= 4" in text, out.stdout
        assert "sliding 8, bidirectional" in text and "the 4 tokens on each side" in text, out.stdout
        assert "not interpreted" not in text  # is_causal (false, as __post_init__ set it) read too
        vision = transformers.Gemma4TextConfig(**sizes, use_bidirectional_attention="vision")
        vision.save_pretrained(tmp_path / "vision")
        assert all(layer["causal"] for layer in anatomy_json(read_anatomy(str(tmp_path / "vision")))["layers"])
