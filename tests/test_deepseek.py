"""DeepSeek-V3 and DeepSeek-V2 (models/families/deepseek.py) against transformers' own models: tiny random checkpoints
saved with save_pretrained (tests/tiny_deepseek.py) with a dense layer then mixture-of-experts layers. The --text
pattern of every layer equals eager output_attentions (so the routers and experts before layer L run as
transformers runs them); head h's weights are the model's parameters sliced; both config forms load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_main import assert_usage_error, run_main
from tiny_deepseek import YARN, build
from tiny_models import SENTENCE

from attnscope.cli import app
from attnscope.models.config import read_config
from attnscope.models.families import open_model
from attnscope.models.tokenizer import encode
from attnscope.models.weights import head_weights
from attnscope.runs.head import model_head

# name -> (version, config overrides): every MLA layout and both routers
VARIANTS = {
    "v3": (3, {}),  # compressed queries, rope_interleave, sigmoid router with groups and a correction bias
    "v3-yarn": (3, {"q_lora_rank": None, "rope_parameters": YARN, "rope_interleave": False, "attention_bias": True}),
    "v2": (2, {}),  # softmax router, group_limited_greedy, mlp_bias, interleaved complex RoPE
    "v2-greedy": (2, {"topk_method": "greedy", "q_lora_rank": None, "rope_parameters": YARN}),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """variant -> (folder, eager model, attentions on SENTENCE), each built the first time a test asks."""
    cache: dict[str, tuple[Path, object, tuple]] = {}

    def get(name: str):
        if name not in cache:
            version, sizes = VARIANTS[name]
            folder = tmp_path_factory.mktemp(name)
            model = build(folder, version, **sizes)
            with torch.no_grad():
                ids = torch.tensor([encode(folder, SENTENCE).ids])
                attentions = model(ids, output_attentions=True).attentions
            cache[name] = folder, model, attentions
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_layer_pattern_equals_eager(built, name):
    folder, _, attentions = built(name)
    for layer in range(3):  # layer 0 dense; 1 and 2 read what the experts of the layers before made
        result = model_head(folder, layer, 2, text=SENTENCE)
        assert torch.allclose(result.all_heads, attentions[layer][0], atol=1e-5)
        assert torch.equal(result.attention, result.all_heads[2])


@pytest.mark.parametrize("name", ["v3", "v2-greedy"])
def test_traced_layer_output_equals_the_attention_modules(built, name):
    """x of layer 2 (after o_proj) against DeepseekV3Attention's own output, hooked on the same sentence."""
    folder, model, _ = built(name)
    seen = {}

    def keep(module, args, out) -> None:  # returns None: the output stays as it is
        seen["x"] = out[0]

    hook = model.model.layers[2].self_attn.register_forward_hook(keep)
    with torch.no_grad():
        model(torch.tensor([encode(folder, SENTENCE).ids]))
    hook.remove()
    result = model_head(folder, 2, 0, text=SENTENCE)
    assert torch.allclose(result.run.layer["x"], seen["x"], atol=1e-5)


def _expected(model, layer: int, head: int) -> dict[str, torch.Tensor]:
    attn = model.model.layers[layer].self_attn
    d_K, d_nope, d_V, rank = attn.qk_head_dim, attn.qk_nope_head_dim, attn.v_head_dim, attn.kv_lora_rank
    kv_a, kv_b, start = attn.kv_a_proj_with_mqa, attn.kv_b_proj.weight, head * (d_nope + d_V)
    expected = {"W_DKV": kv_a.weight[:rank], "g_DKV": attn.kv_a_layernorm.weight, "W_KR": kv_a.weight[rank:],
                "W_UK": kv_b[start:start + d_nope], "W_UV": kv_b[start + d_nope:start + d_nope + d_V],
                "W_O": attn.o_proj.weight[:, head * d_V:(head + 1) * d_V]}
    if attn.q_lora_rank is None:
        expected["W_Q"] = attn.q_proj.weight[head * d_K:(head + 1) * d_K]
    else:
        expected |= {"W_DQ": attn.q_a_proj.weight, "g_DQ": attn.q_a_layernorm.weight,
                     "W_UQ": attn.q_b_proj.weight[head * d_K:(head + 1) * d_K]}
    if kv_a.bias is not None:
        expected |= {"b_DKV": kv_a.bias[:rank], "b_KR": kv_a.bias[rank:]}
        if attn.q_a_proj is not None:
            expected["b_DQ"] = attn.q_a_proj.bias
    return expected


@pytest.mark.parametrize("name", ["v3", "v3-yarn"])
def test_dumped_slices_equal_the_models_parameters(built, name):
    folder, model, _ = built(name)
    family = open_model(folder, read_config(folder))
    with family.checkpoint:
        for layer, head in ((0, 0), (2, 3)):
            weights = head_weights(family, layer, head)
            expected = _expected(model, layer, head)
            assert set(weights.tensors) == set(expected)
            for key, tensor in weights.as_torch().items():
                assert torch.equal(tensor, expected[key].detach()), key
            assert weights.dims["W_UV"] == ("d_V", "d_latent") and weights.dims["W_O"] == ("d_model", "d_V")
            assert weights.sources["W_UK"].endswith(f"kv_b_proj.weight[{head * 22}:{head * 22 + 10}, :]")


def test_yarn_scale_and_rope_are_transformers(built):
    folder, model, _ = built("v3-yarn")
    family = open_model(folder, read_config(folder))
    spec = family.attention_spec(1)
    assert spec.scale == pytest.approx(model.model.layers[1].self_attn.scaling, rel=1e-12)
    assert spec.rope.kind == "yarn" and spec.rope.attention_scaling == pytest.approx(
        model.model.rotary_emb.attention_scaling)
    assert family.latent.rope_interleave is False and spec.rope.pairing == "half-split"
    v2 = open_model(built("v2")[0], read_config(built("v2")[0]))
    assert v2.attention_spec(0).rope.pairing == "interleaved" and v2.latent.rope_interleave is False


def test_cli_json_save_and_all_heads(runner, built, tmp_path):
    folder, model, attentions = built("v3")
    saved = tmp_path / "head.safetensors"
    result = runner.invoke(app, ["head", "--model", str(folder), "--layer", "1", "--head", "3", "--text", SENTENCE,
                                 "--json", "--save", str(saved), "--all-heads"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["model"]["latent"] == {"kv_lora_rank": 16, "qk_nope_head_dim": 10, "qk_rope_head_dim": 8,
                                          "v_head_dim": 12, "q_lora_rank": 24, "rope_interleave": True, "rotary": True,
                                          "d_K": 18, "d_V": 12}
    assert payload["layer_attention"]["latent"]["d_K"] == 18
    assert [s["name"] for s in payload["steps"]] == ["X", "Q_nope", "Q_pe", "KV_latent", "K_pe", "Q_pe_rot",
                                                     "K_pe_rot", "Q_full", "K_nope", "V", "K_full", "scores",
                                                     "masked_scores", "attention", "out"]
    layer_steps = {s["name"]: s for s in payload["layer_steps"]}
    assert layer_steps["KV_latent"]["dims"] == ["n_batch", "n_tokens", "d_latent"]
    assert layer_steps["Q_latent"]["op"] == "q_a_proj(X)"
    assert torch.allclose(torch.tensor(payload["attention"]), attentions[1][0, 3], atol=1e-5)
    assert len(payload["heads"]) == 4
    from safetensors.torch import load_file

    tensors = load_file(saved)
    assert torch.equal(tensors["W_UQ"], model.model.layers[1].self_attn.q_b_proj.weight[54:72].detach())
    assert torch.equal(tensors["KV_latent"], tensors["layer.KV_latent"][0])  # every head's latent
    assert torch.allclose(tensors["attention"], attentions[1][0, 3], atol=1e-5)
    table = runner.invoke(app, ["head", "--model", str(folder), "--layer", "2", "--text", SENTENCE])
    assert "MLA (query latent 24, KV latent 16 + RoPE part 8; d_K 18 = 10 + 8, d_V 12)" in table.output
    assert "W_UK" in table.output and "d_head is config.json's head_dim" not in table.output


def _variant(source: Path, tmp_path: Path, name: str, edit) -> Path:
    folder = tmp_path / name
    shutil.copytree(source, folder)
    path = folder / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    return folder


def _as_4x(config: dict) -> dict:
    """The form transformers 4.4x and DeepSeek's own checkpoints save: rope_theta + rope_scaling (`type`), no
    head_dim (5.x writes qk_rope_head_dim there), no rope_interleave (its default, true)."""
    parameters = dict(config.pop("rope_parameters"))
    theta = parameters.pop("rope_theta")
    kind = parameters.pop("rope_type")
    for key in ("head_dim", "qk_head_dim", "rope_interleave" if config.get("rope_interleave") else "_"):
        config.pop(key, None)
    return config | {"rope_theta": theta, "rope_scaling": None if kind == "default" else {"type": kind, **parameters}}


@pytest.mark.parametrize("name", ["v3", "v3-yarn", "v2-greedy"])
def test_configs_saved_by_transformers_4_load_the_same(built, tmp_path, name):
    source, _, attentions = built(name)
    folder = _variant(source, tmp_path, name, _as_4x)
    for layer in (1, 2):
        result = model_head(folder, layer, 1, text=SENTENCE)
        assert torch.allclose(result.all_heads, attentions[layer][0], atol=1e-5)


def test_fused_expert_tensors_give_the_same_layer(built, tmp_path):
    """transformers 5 holds the experts fused (`experts.gate_up_proj`, `experts.down_proj`); a checkpoint saved
    that way runs the same."""
    from safetensors.torch import load_file, save_file

    source, _, attentions = built("v3")
    folder = tmp_path / "fused"
    shutil.copytree(source, folder)
    state = load_file(folder / "model.safetensors")
    for layer in (1, 2):
        stem = f"model.layers.{layer}.mlp.experts"
        gates, ups, downs = ([state.pop(f"{stem}.{e}.{part}_proj.weight") for e in range(8)]
                             for part in ("gate", "up", "down"))
        state[f"{stem}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups, strict=True)])
        state[f"{stem}.down_proj"] = torch.stack(downs)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    result = model_head(folder, 2, 0, text=SENTENCE)
    assert torch.allclose(result.all_heads, attentions[2][0], atol=1e-5)


@pytest.mark.parametrize(("name", "edit", "phrases"), [
    ("v3", lambda c: c | {"qk_rope_head_dim": 7}, ("qk_rope_head_dim 7 is odd",)),
    ("v3", lambda c: c | {"n_group": 3}, ("8 routed experts in n_group 3 groups",)),
    ("v3", lambda c: c | {"n_group": 8, "topk_group": 2}, ("hold at least 2 each",)),
    ("v2-greedy", lambda c: c | {"num_experts_per_tok": 9}, ("num_experts_per_tok 9 is more than the 8",)),
    ("v3", lambda c: c | {"rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}, ("RoPE type 'axial'",)),
    ("v3", lambda c: c | {"kv_lora_rank": "wide"}, ("kv_lora_rank is 'wide'",)),
    ("v2", lambda c: c | {"topk_method": "noaux_tc"}, ("topk_method 'noaux_tc'", "greedy, group_limited_greedy")),
])
def test_bad_configs_are_one_line(built, tmp_path, name, edit, phrases):
    folder = _variant(built(name)[0], tmp_path, "bad", edit)
    assert_usage_error(run_main("head", "--model", str(folder), "--layer", "2", "--text", SENTENCE), *phrases)


def test_a_missing_expert_is_one_line(runner, built, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "missing"
    shutil.copytree(built("v3")[0], folder)
    state = {k: v for k, v in load_file(folder / "model.safetensors").items() if ".mlp.experts." not in k}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    assert runner.invoke(app, ["head", "--model", str(folder), "--layer", "2"]).exit_code == 0  # weights alone
    assert_usage_error(run_main("head", "--model", str(folder), "--layer", "2", "--text", SENTENCE), "mlp.experts")


def test_the_memory_estimate_counts_the_experts_a_text_can_reach(built):
    """8 tokens x 3 experts each can reach all 8 experts of layer 1, 1 token only 3 of them."""
    folder = built("v3")[0]
    family = open_model(folder, read_config(folder))
    experts = [k for k in family.checkpoint.keys if k.startswith("model.layers.1.mlp.experts.")]
    held = 2 * sum(family.checkpoint.nbytes(k) for k in experts)
    weights = {n: family.estimate_bytes(1, n) - _activations(n) for n in (1, 8)}
    assert weights[8] - weights[1] == held - held * 3 // 8  # float32 experts: stored and upcast, 2x their bytes
    assert family.estimate_bytes(0, 8) < family.estimate_bytes(1, 8)


def _activations(n_tokens: int) -> int:
    """Family.estimate_bytes's activations for the tiny model (d_model 32, 4 heads)."""
    return 4 * n_tokens * (40 * 32 + 4 * 4 * n_tokens)


def test_a_float8_checkpoint_is_refused_in_one_line(built, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _variant(built("v3")[0], tmp_path, "fp8", lambda c: c | {"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}})
    state = load_file(folder / "model.safetensors")
    state["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    assert_usage_error(run_main("head", "--model", str(folder)), "quantized (fp8", "fp8_cast_bf16.py")


def test_key_value_heads_other_than_the_heads_are_refused_in_one_line(built, tmp_path):
    """MLA gives every head its own key and value; transformers' DeepseekV3Attention repeats them by
    num_attention_heads // num_key_value_heads, so its own forward fails on any other count (found by the fuzzed
    config run): attnscope refuses the config naming both fields, where it used to run and --check failed in eager."""
    folder, *_ = built("v3")

    def fewer(config: dict) -> dict:
        return {**config, "num_key_value_heads": 1}

    changed = _variant(folder, tmp_path, "kv1", fewer)
    assert_usage_error(run_main("head", "--model", str(changed), "--layer", "1", "--text", SENTENCE),
                       "num_key_value_heads 1 is not num_attention_heads 4", "make them equal")
