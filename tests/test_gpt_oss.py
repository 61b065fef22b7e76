"""GPT-OSS, traced natively, against transformers' own GptOssForCausalLM (eager, output_attentions): a tiny random
model of sliding, full and sliding layers, GQA, sinks, yarn RoPE and a mixture of experts whose clamped SwiGLU
reaches its limit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny_models import SENTENCE, build, eager_run, refuses_config, with_config

from attnscope.cli import app
from attnscope.models.config import read_config
from attnscope.models.families import open_model
from attnscope.models.weights import head_weights
from attnscope.runs.head import HeadOptions, run_head

WINDOW = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss")
    return folder, build("gpt_oss", folder)


def _eager(model, folder):
    return eager_run(model, folder, [layer.self_attn for layer in model.model.layers])


@pytest.fixture(scope="module")
def eager(tiny):
    return _eager(tiny[1], tiny[0])


def test_every_head_of_every_layer_equals_eager(tiny, eager):
    folder, _ = tiny
    ids, attentions, outputs = eager
    for layer, per_layer in enumerate(attentions):
        for head in (layer, 3):  # a head of each KV head across the layers; every head through all_heads
            result = run_head(HeadOptions(model=str(folder), layer=layer, head=head, text=SENTENCE))
            assert result.encoded.ids == ids
            torch.testing.assert_close(result.attention, per_layer[0, head], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(result.run.head["sink_weight"], 1 - per_layer[0, head].sum(-1), atol=1e-5,
                                       rtol=1e-5)
        torch.testing.assert_close(result.all_heads, per_layer[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result.run.layer["x"], outputs[layer], atol=1e-5, rtol=1e-5)


def test_dumped_slices_and_sinks_equal_the_parameters(tiny):
    folder, model = tiny
    opened = open_model(folder, read_config(folder))
    for layer in range(3):
        attn = model.model.layers[layer].self_attn
        for head in range(4):
            weights = head_weights(opened, layer, head).as_torch()
            q, kv = slice(head * 8, head * 8 + 8), slice(head // 2 * 8, head // 2 * 8 + 8)
            expected = {"W_Q": attn.q_proj.weight[q], "W_K": attn.k_proj.weight[kv], "W_V": attn.v_proj.weight[kv],
                        "b_Q": attn.q_proj.bias[q], "b_K": attn.k_proj.bias[kv], "b_V": attn.v_proj.bias[kv],
                        "W_O": attn.o_proj.weight[:, q], "sink": attn.sinks[head : head + 1]}
            assert list(weights) == list(expected)
            for name, tensor in expected.items():
                torch.testing.assert_close(weights[name], tensor.detach(), rtol=0, atol=0)
    sources = head_weights(opened, 1, 3).sources
    assert sources["sink"] == "model.layers.1.self_attn.sinks[3:4]"
    assert sources["b_K"] == "model.layers.1.self_attn.k_proj.bias[8:16]"


@pytest.mark.parametrize(("layer", "window"), [(0, WINDOW), (1, None), (2, WINDOW)])
def test_every_step_of_layer_l(tiny, layer, window):
    result = run_head(HeadOptions(model=str(tiny[0]), layer=layer, head=1, text=SENTENCE))
    names = [step.name for step in result.run.layer.steps]
    assert names == ["X", "Q_feat", "K_feat", "V_feat", "Q_split", "K_split", "V_split", "cos", "sin", "Q_rot",
                     "K_rot", "K_rep", "V_rep", "scores", "masked_scores", "sinks", "attention", "sink_weight",
                     "x_raw", "x_rsh1", "x_rsh2", "x", "value_norms", "weighted"]
    assert [s.name for s in result.run.head.steps] == ["X", "Q", "K", "V", "Q_rot", "K_rot", "scores",
                                                       "masked_scores", "sinks", "attention", "sink_weight", "out",
                                                       "value_norms", "weighted"]
    assert result.run.head.step("sinks").op == "sinks[1]" and result.run.head["sinks"].dim() == 0
    assert result.run.spec.window == window and result.run.spec.sinks
    op = result.run.layer.step("masked_scores").op
    assert op.endswith("~window(4, upper-left), -inf)" if window else "~causal(upper-left), -inf)")
    assert "yarn" in result.run.layer.step("cos").op
    n = result.attention.shape[0]
    far = torch.ones(n, n, dtype=torch.bool).tril(-WINDOW)
    assert bool((result.attention[far] == 0).all()) == (window is not None)
    assert any("sums to 1 - sink_weight" in note for note in result.notes)


def test_moe_mlp_equals_gpt_oss_mlp(tiny):
    """The router, top-k softmax and clamped SwiGLU experts against GptOssMLP on inputs that reach the clamp."""
    folder, model = tiny
    opened = open_model(folder, read_config(folder))
    x = torch.randn(1, 9, 32) * 3
    with torch.no_grad():
        theirs, _ = model.model.layers[1].mlp(x)
        ours = opened.mlp(1, x)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    gate_up = opened.expert(1, 0)[0]
    assert bool(((x.reshape(-1, 32) @ gate_up)[..., ::2] > opened.limit).any())  # the clamp is exercised


def test_mxfp4_dequantized_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from attnscope.models.families.gpt_oss import dequantize_mxfp4

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 6, 2, 16), generator=generator, dtype=torch.uint8)  # [n_expert, out, G, 16]
    scales = torch.randint(120, 134, (3, 6, 2), generator=generator, dtype=torch.uint8)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [n_expert, G·32, out]
    for expert in range(3):
        assert torch.equal(dequantize_mxfp4(blocks[expert], scales[expert]), expected[expert])


def test_mxfp4_checkpoint_runs_as_its_dequantized_model(tmp_path):
    """OpenAI's release stores the experts as MXFP4 blocks and scales: a layer after an MoE equals eager on the
    same weights dequantized by transformers."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder = tmp_path / "float"
    model = build("gpt_oss", folder, intermediate_size=32)  # MXFP4 packs 32 values a block
    generator = torch.Generator().manual_seed(1)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for layer in range(3):
        experts = model.model.layers[layer].mlp.experts
        for name, shape in (("gate_up_proj", (4, 64, 1, 16)), ("down_proj", (4, 32, 1, 16))):
            blocks = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
            scales = torch.randint(124, 128, shape[:-1], generator=generator, dtype=torch.uint8)
            with torch.no_grad():
                getattr(experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            key = f"model.layers.{layer}.mlp.experts.{name}"
            del state[key]
            state |= {f"{key}_blocks": blocks, f"{key}_scales": scales}
    packed = tmp_path / "mxfp4"
    packed.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, packed / name)
    save_file(state, str(packed / "model.safetensors"))
    _, attentions, outputs = _eager(model, folder)
    result = run_head(HeadOptions(model=str(packed), layer=2, head=3, text=SENTENCE))
    torch.testing.assert_close(result.attention, attentions[2][0, 3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.run.layer["x"], outputs[2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", ["4.4x", "no layer_types"])
def test_older_config_forms(tiny, tmp_path, form):
    """rope_theta + rope_scaling (transformers 4.55's GPT-OSS) instead of rope_parameters; layer_types left out
    (GptOssConfig's default: even layers slide). transformers reads the same folder as the reference."""
    from transformers import GptOssForCausalLM

    def older(config: dict) -> dict:
        if form == "no layer_types":
            return {k: v for k, v in config.items() if k != "layer_types"}
        scaling = dict(config.pop("rope_parameters"))
        return config | {"rope_theta": scaling.pop("rope_theta"), "rope_scaling": scaling}

    folder = with_config(tiny[0], tmp_path / "old", older)
    reference = GptOssForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    _, attentions, _ = _eager(reference, folder)
    for layer in (1, 2):
        result = run_head(HeadOptions(model=str(folder), layer=layer, head=2, text=SENTENCE))
        torch.testing.assert_close(result.attention, attentions[layer][0, 2], atol=1e-5, rtol=1e-5)
        assert result.run.spec.window == (WINDOW if layer == 2 else None)


def test_json_and_save(runner, tiny, tmp_path):
    target = tmp_path / "head.safetensors"
    result = runner.invoke(app, ["head", "--model", str(tiny[0]), "--layer", "2", "--head", "3", "--text", SENTENCE,
                                 "--json", "--save", str(target), "--all-heads"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["layer_attention"]["sinks"] is True and payload["layer_attention"]["window"] == WINDOW
    assert payload["layer_attention"]["window_side"] == "left" and payload["layer_attention"]["kv_head"] == 1
    assert [t["name"] for t in payload["tensors"]][-1] == "sink"
    assert len(payload["heads"]) == 4
    from safetensors.torch import load_file

    saved = load_file(target)
    assert {"sink", "sinks", "sink_weight", "layer.sinks", "layer.sink_weight", "attention"} <= set(saved)
    assert saved["layer.sink_weight"].shape == (1, 4, len(payload["tokens"]))


@pytest.mark.parametrize(("edit", "message"), [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than num_local_experts 4"),
    ({"rope_parameters": {"rope_type": "ntk-by-parts", "rope_theta": 10000.0}}, "ntk-by-parts"),
    ({"swiglu_limit": "high"}, "swiglu_limit"),
    ({"intermediate_size": 12}, "intermediate_size 12 make it [32, 24]; config.json does not describe these weights"),
])
def test_bad_configs_are_one_line(runner, tiny, tmp_path, edit, message):
    refuses_config(runner, tiny[0], tmp_path / "bad", edit, message)


def test_missing_sinks_are_one_line(runner, tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "nosinks"
    shutil.copytree(tiny[0], folder)
    state = load_file(folder / "model.safetensors")
    del state["model.layers.0.self_attn.sinks"]
    save_file(state, str(folder / "model.safetensors"))
    result = runner.invoke(app, ["head", "--model", str(folder), "--layer", "0", "--head", "0"])
    assert result.exit_code == 2, result.output
    assert "no tensor model.layers.0.self_attn.sinks" in result.stderr
