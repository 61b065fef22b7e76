"""Qwen3, Qwen3-MoE, Gemma 3 (text, and the text part of the multimodal checkpoint) and OLMo 2 against transformers'
own models: tiny random ones saved with save_pretrained (tiny_qknorm_models.py). The dumped slices equal the
model's parameters; the --text pattern of every head of every layer type equals eager output_attentions to 1e-5;
the traced layer's output equals the attention module's; configs in transformers 4.4x's form read the same."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_main import assert_usage_error, run_main
from tiny_models import SENTENCE, cached_builder
from tiny_qknorm_models import FAMILIES, WINDOW, build, decoder_layers

from attnscope.cli import app
from attnscope.models.config import read_config
from attnscope.models.families import open_model
from attnscope.models.weights import head_weights
from attnscope.runs.head import HeadOptions, run_head


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (folder, eager model), each built the first time a test asks for it."""
    return cached_builder(tmp_path_factory, build)


def _eager(folder: Path, model) -> tuple[list[int], tuple, dict[int, torch.Tensor]]:
    """Input ids, eager attentions and each attention module's output on SENTENCE, from transformers."""
    from transformers import AutoTokenizer

    encoded = AutoTokenizer.from_pretrained(folder)(SENTENCE, return_tensors="pt")
    outputs: dict[int, torch.Tensor] = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out[0]))
             for i, layer in enumerate(decoder_layers(model))]
    with torch.no_grad():
        attentions = model(input_ids=encoded["input_ids"], output_attentions=True).attentions
    for hook in hooks:
        hook.remove()
    return encoded["input_ids"][0].tolist(), attentions, outputs


def _variant(source: Path, tmp_path: Path, edit) -> Path:
    folder = tmp_path / "variant"
    shutil.copytree(source, folder)
    path = folder / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    return folder


def _open(folder: Path):
    return open_model(folder, read_config(folder))


# --- the pattern on a sentence, every layer type and head --------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_text_pattern_and_output_equal_eager_for_every_head(built, family):
    folder, model = built(family)
    ids, attentions, outputs = _eager(folder, model)
    assert len(ids) > 2 * WINDOW
    for layer, per_layer in enumerate(attentions):
        for head in range(per_layer.shape[1]):
            result = run_head(HeadOptions(model=str(folder), layer=layer, head=head, text=SENTENCE))
            assert result.traced and result.encoded.ids == ids
            torch.testing.assert_close(result.attention, per_layer[0, head], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result.run.layer["x"], outputs[layer], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("family", "windows", "bases"), [
    ("qwen3", [None, WINDOW, WINDOW], [10000.0] * 3),
    ("qwen3_moe", [None] * 3, [10000.0] * 3),
    ("gemma3_text", [WINDOW, None, WINDOW], [10000.0, 1e6, 10000.0]),
    ("gemma3", [WINDOW, None, WINDOW], [10000.0, 1e6, 10000.0]),
    ("olmo2", [None] * 2, [500000.0] * 2),
])
def test_layer_types_windows_and_rope_bases(built, family, windows, bases):
    opened = _open(built(family)[0])
    specs = [opened.attention_spec(layer) for layer in range(opened.n_layer)]
    assert [s.window for s in specs] == windows
    assert [s.rope.base for s in specs] == bases
    assert all(s.norm is not None and s.norm.over == ("proj" if family == "olmo2" else "head") for s in specs)
    assert all(s.norm.offset == family.startswith("gemma3") for s in specs)
    assert all(s.softcap is None for s in specs)  # Gemma 3's config sets one, its attention does not use it


def test_rope_inverse_frequencies_per_layer_type_equal_transformers(built):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    folder, model = built("gemma3_text")
    rotary = Gemma3RotaryEmbedding(model.config)
    opened = _open(folder)
    for layer, kind in enumerate(model.config.layer_types):
        ours = opened.attention_spec(layer).rope.inv_freq(opened.d_head)
        torch.testing.assert_close(ours.float(), getattr(rotary, f"{kind}_inv_freq"), atol=0, rtol=1e-6)


@pytest.mark.parametrize(("family", "names"), [
    ("qwen3", ["X", "Q", "K", "V", "Q_normed", "K_normed", "Q_rot", "K_rot", "scores", "masked_scores", "attention",
               "out", "value_norms", "weighted"]),
    ("olmo2", ["X", "Q", "K", "V", "Q_rot", "K_rot", "scores", "masked_scores", "attention", "out", "value_norms",
               "weighted"]),
])
def test_head_steps_slice_the_layer(built, family, names):
    result = run_head(HeadOptions(model=str(built(family)[0]), layer=1, head=3, text=SENTENCE))
    layer, head = result.run.layer, result.run.head
    assert [s.name for s in head.steps] == names
    torch.testing.assert_close(head["out"], head["attention"] @ head["V"])
    if family == "qwen3":  # head 3 is served by KV head 1
        torch.testing.assert_close(head["K_normed"], layer["K_normed"][0, 1])
        assert head.step("Q_normed").op == "Q_normed[0, 3]"
        assert [s.name for s in layer.steps][4:9] == ["Q_split", "K_split", "V_split", "Q_normed", "K_normed"]
    else:  # the norm ran over the whole projection: head h's Q is its slice of the normed projection
        d = result.info.d_head
        torch.testing.assert_close(head["Q"], layer["Q_normed"][0, :, 3 * d : 4 * d])
        assert head.step("Q").op == "Q_split[0, 3] = RMSNorm(X @ W_Q.T) over every head, then split"
        assert [s.name for s in layer.steps][1:6] == ["Q_feat", "K_feat", "V_feat", "Q_normed", "K_normed"]
        assert layer.step("X").op.startswith("h: the residual stream entering layer 1")


# --- where head h lives -------------------------------------------------------------------------------------------


def _attention_module(model, layer: int):
    return decoder_layers(model)[layer].self_attn


@pytest.mark.parametrize("family", FAMILIES)
def test_dumped_slices_equal_the_models_parameters(built, family):
    folder, model = built(family)
    opened = _open(folder)
    for layer in range(opened.n_layer):
        attn = _attention_module(model, layer)
        d, group = attn.head_dim, attn.num_key_value_groups
        for head in (0, 3):
            q, kv = slice(head * d, (head + 1) * d), slice(head // group * d, (head // group + 1) * d)
            expected = {"W_Q": attn.q_proj.weight[q], "W_K": attn.k_proj.weight[kv], "W_V": attn.v_proj.weight[kv]}
            if attn.q_proj.bias is not None:
                expected |= {"b_Q": attn.q_proj.bias[q], "b_K": attn.k_proj.bias[kv], "b_V": attn.v_proj.bias[kv]}
            expected["W_O"] = attn.o_proj.weight[:, q]
            whole = family != "olmo2"  # per head: the one [d_head] weight; OLMo 2: head h's rows
            expected["q_norm"] = attn.q_norm.weight if whole else attn.q_norm.weight[q]
            expected["k_norm"] = attn.k_norm.weight if whole else attn.k_norm.weight[kv]
            weights = head_weights(opened, layer, head).as_torch()
            assert list(weights) == list(expected)
            for name, tensor in expected.items():
                torch.testing.assert_close(weights[name], tensor.detach(), rtol=0, atol=0, msg=f"{family} {name}")


@pytest.mark.parametrize(("family", "sources"), [
    ("qwen3", {"b_Q": "model.layers.1.self_attn.q_proj.bias[48:64]",
               "q_norm": "model.layers.1.self_attn.q_norm.weight[0:16]"}),
    ("gemma3", {"W_Q": "language_model.model.layers.1.self_attn.q_proj.weight[48:64, :]",
                "k_norm": "language_model.model.layers.1.self_attn.k_norm.weight[0:16]"}),
    ("olmo2", {"q_norm": "model.layers.1.self_attn.q_norm.weight[24:32]",
               "k_norm": "model.layers.1.self_attn.k_norm.weight[8:16]"}),
])
def test_sources_name_key_and_slice(built, family, sources):
    weights = head_weights(_open(built(family)[0]), 1, 3)
    assert {name: weights.sources[name] for name in sources} == sources


def test_notes_say_how_each_norm_reads_and_what_gemma3_leaves_out(runner, built):
    gemma = runner.invoke(app, ["head", "--model", str(built("gemma3")[0]), "--layer", "1", "--head", "0"])
    assert gemma.exit_code == 0, gemma.output
    text = " ".join(gemma.stdout.split())
    assert "Gemma3ForConditionalGeneration (gemma3): layer 1, head 0" in text
    assert "one [d_head] (1 + w) RMSNorm weight that every head shares" in text
    assert "attn_logit_softcapping 5, which Gemma 3 does not apply" in text
    olmo = runner.invoke(app, ["head", "--model", str(built("olmo2")[0]), "--layer", "0", "--head", "2"])
    assert "the norm's mean runs over every head's coordinates" in " ".join(olmo.stdout.split())


# --- Qwen3-MoE's experts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_block_equals_qwen3moe_sparse_block(built, norm_topk_prob, tmp_path):
    folder, model = built("qwen3_moe")
    if not norm_topk_prob:
        folder = _variant(folder, tmp_path, lambda c: c | {"norm_topk_prob": False})
        model.config.norm_topk_prob = False
        for layer in decoder_layers(model):
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.norm_topk_prob = False
    opened = _open(folder)
    x = torch.randn(1, 9, 32) * 2
    with opened.checkpoint:
        for layer, theirs in enumerate(decoder_layers(model)):
            assert opened.sparse(layer) == (layer != 1) == hasattr(theirs.mlp, "gate")
            with torch.no_grad():
                torch.testing.assert_close(opened.mlp(layer, x), theirs.mlp(x), atol=1e-6, rtol=1e-5)
    model.config.norm_topk_prob = True
    for layer in decoder_layers(model):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.norm_topk_prob = True


def test_moe_sparse_step_and_fused_experts(built, tmp_path):
    """decoder_sparse_step 2 makes only odd layers MoE; fused expert tensors (transformers 5's in-memory layout)
    read as the per-expert keys."""
    from safetensors.torch import load_file, save_file

    folder = _variant(built("qwen3_moe")[0], tmp_path, lambda c: c | {"decoder_sparse_step": 2, "mlp_only_layers": []})
    assert [_open(folder).sparse(layer) for layer in range(3)] == [False, True, False]
    fused = tmp_path / "fused"
    shutil.copytree(built("qwen3_moe")[0], fused)
    state = load_file(fused / "model.safetensors")
    for layer in (0, 2):
        stem = f"model.layers.{layer}.mlp.experts"
        state[f"{stem}.gate_up_proj"] = torch.stack([torch.cat([state.pop(f"{stem}.{e}.gate_proj.weight"),
                                                                state.pop(f"{stem}.{e}.up_proj.weight")])
                                                     for e in range(4)])
        state[f"{stem}.down_proj"] = torch.stack([state.pop(f"{stem}.{e}.down_proj.weight") for e in range(4)])
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    plain = run_head(HeadOptions(model=str(built("qwen3_moe")[0]), layer=2, head=1, text=SENTENCE))
    result = run_head(HeadOptions(model=str(fused), layer=2, head=1, text=SENTENCE))
    torch.testing.assert_close(result.attention, plain.attention, atol=0, rtol=0)


# --- configs as transformers 4.4x saved them ---------------------------------------------------------------------


def _old_form(config: dict) -> dict:
    """transformers 4.4x's keys: rope_theta (+ rope_local_base_freq, sliding_window_pattern for Gemma 3) in place of
    rope_parameters and layer_types."""
    config = dict(config)
    text = dict(config["text_config"]) if "text_config" in config else config
    parameters = text.pop("rope_parameters")
    if "full_attention" in parameters:
        text["rope_theta"] = parameters["full_attention"]["rope_theta"]
        text["rope_local_base_freq"] = parameters["sliding_attention"]["rope_theta"]
        text["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}  # Gemma 3 4B's, on the full layers only
        text.pop("layer_types")
        text["sliding_window_pattern"] = 2
    else:
        text["rope_theta"] = parameters["rope_theta"]
    if "text_config" in config:
        config["text_config"] = text
    return config


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "olmo2"])
def test_configs_saved_by_transformers_4_load(built, tmp_path, family):
    from transformers import AutoModelForCausalLM, Gemma3ForConditionalGeneration

    source, _ = built(family)
    folder = _variant(source, tmp_path, _old_form)
    cls = Gemma3ForConditionalGeneration if family == "gemma3" else AutoModelForCausalLM
    reference = cls.from_pretrained(folder, attn_implementation="eager").eval()
    _, attentions, _ = _eager(folder, reference)
    for layer in range(len(attentions)):
        result = run_head(HeadOptions(model=str(folder), layer=layer, head=2, text=SENTENCE))
        torch.testing.assert_close(result.attention, attentions[layer][0, 2], atol=1e-5, rtol=1e-5)
    if family == "gemma3":  # the pattern of 2 gives the same layer types; linear scaling on the full layer only
        opened = _open(folder)
        assert [opened.attention_spec(layer).rope.kind for layer in range(3)] == ["default", "linear", "default"]


def test_gemma3_text_config_with_defaults_left_out(built, tmp_path):
    """Hub configs of the multimodal Gemma 3 leave Gemma3TextConfig's defaults out of text_config."""
    from transformers import Gemma3ForConditionalGeneration, Gemma3TextConfig

    from attnscope.models.families.gemma3 import TEXT_DEFAULTS

    defaults = Gemma3TextConfig()
    assert {key: getattr(defaults, key) for key in TEXT_DEFAULTS} == TEXT_DEFAULTS

    def trim(config: dict) -> dict:
        kept = {k: v for k, v in config["text_config"].items() if k not in ("rms_norm_eps", "attention_bias",
                                                                             "hidden_activation")}
        return config | {"text_config": kept}

    folder = _variant(built("gemma3")[0], tmp_path, trim)
    reference = Gemma3ForConditionalGeneration.from_pretrained(folder, attn_implementation="eager").eval()
    _, attentions, _ = _eager(folder, reference)
    result = run_head(HeadOptions(model=str(folder), layer=2, head=1, text=SENTENCE))
    torch.testing.assert_close(result.attention, attentions[2][0, 1], atol=1e-5, rtol=1e-5)


# --- the command ----------------------------------------------------------------------------------------------


def test_cli_json_save_and_all_heads(runner, built, tmp_path):
    folder, model = built("qwen3")
    _, attentions, _ = _eager(folder, model)
    target = tmp_path / "run.safetensors"
    result = runner.invoke(app, ["head", "--model", str(folder), "--layer", "2", "--head", "3", "--text", SENTENCE,
                                 "--json", "--save", str(target), "--all-heads"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["traced"] is True and payload["model"]["model_type"] == "qwen3"
    assert [t["name"] for t in payload["tensors"]] == ["W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "W_O", "q_norm",
                                                       "k_norm"]
    assert payload["tensors"][-1]["dims"] == ["d_head"] and payload["tensors"][-1]["shape"] == [16]
    assert payload["layer_attention"]["qk_norm"] == {"over": "head", "eps": 1e-6, "plus_one": False}
    assert payload["layer_attention"]["window"] == WINDOW
    for h, entry in enumerate(payload["heads"]):
        torch.testing.assert_close(torch.tensor(entry["attention"]), attentions[2][0, h], atol=1e-5, rtol=1e-5)
    from safetensors.torch import load_file

    saved = load_file(target)
    assert {"q_norm", "k_norm", "Q_normed", "K_normed", "layer.Q_normed", "layer.K_normed"} <= set(saved)


@pytest.mark.parametrize(("family", "edit", "phrases"), [
    ("gemma3_text", lambda c: c | {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     ["layer_types[1] is 'chunked_attention'"]),
    ("gemma3", lambda c: c | {"text_config": c["text_config"] | {"rope_parameters": {
        "full_attention": {"rope_type": "axial", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}}, ["RoPE type 'axial'"]),
    ("qwen3_moe", lambda c: c | {"mlp_only_layers": "1"}, ["mlp_only_layers is '1'"]),
    ("qwen3_moe", lambda c: c | {"num_experts_per_tok": 9}, ["num_experts_per_tok 9 is more than the 4 experts"]),
    ("qwen3_moe", lambda c: c | {"num_local_experts": 5}, ["routes to 4 experts but config.json says 5"]),
    ("olmo2", lambda c: c | {"rms_norm_eps": "tiny"}, ["rms_norm_eps is 'tiny'"]),
])
def test_bad_configs_are_one_line(built, tmp_path, family, edit, phrases):
    folder = _variant(built(family)[0], tmp_path, edit)
    assert_usage_error(run_main("head", "--model", str(folder), "--layer", "1", "--text", SENTENCE), *phrases)


def test_missing_norm_weight_is_one_line(built, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "incomplete"
    shutil.copytree(built("olmo2")[0], folder)
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    assert_usage_error(run_main("head", "--model", str(folder), "--layer", "1"),
                       "no tensor model.layers.1.self_attn.k_norm.weight")


def test_moe_estimate_counts_one_expert_in_float32_not_all(built):
    opened = _open(built("qwen3_moe")[0])
    with opened.checkpoint:
        # the shared count: layers 0..2's weights stored and in float32, every expert's too, and the activations
        shared = opened.weight_bytes(2) + 4 * 16 * (40 * opened.d_model + 4 * opened.n_head * 16)
        experts = sum(4 * opened._numel(k) for k in opened.checkpoint.keys if ".mlp.experts." in k)
        assert experts > 0
        assert opened.estimate_bytes(2, 16) == shared - experts + 2 * 4 * 3 * 16 * 32
