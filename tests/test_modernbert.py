"""ModernBERT, traced natively, against transformers' own ModernBertForMaskedLM (eager, output_attentions): a tiny
random model of global, local, local and global layers, the local ones a bidirectional window shorter than the
text; the fused Wqkv sliced per head; both config forms; `attnscope bert` takes it."""

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

REACH = 2  # local_attention 4: two keys either side


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("modernbert")
    return folder, build("modernbert", folder)


def _eager(model, folder):
    return eager_run(model, folder, [layer.attn for layer in getattr(model, "model", model).layers])


def _every_head_equals_eager(folder, model) -> None:
    """Every head through the layer's traced attention (`all_heads`), head h's own pattern for one head a layer."""
    ids, attentions, outputs = _eager(model, folder)
    for layer, per_layer in enumerate(attentions):
        head = layer % per_layer.shape[1]
        result = run_head(HeadOptions(model=str(folder), layer=layer, head=head, text=SENTENCE))
        assert result.encoded.ids == ids
        torch.testing.assert_close(result.all_heads, per_layer[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result.attention, per_layer[0, head], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result.run.layer["x"], outputs[layer], atol=1e-5, rtol=1e-5)


def test_every_head_of_every_layer_equals_eager(tiny):
    _every_head_equals_eager(*tiny)


def test_with_every_bias_and_as_a_base_model(tmp_path):
    """attention_bias, norm_bias and mlp_bias on; ModernBertModel saves its keys without `model.`."""
    from transformers import ModernBertModel

    folder = tmp_path / "biased"
    masked = build("modernbert", folder, attention_bias=True, norm_bias=True, mlp_bias=True)
    _every_head_equals_eager(folder, masked)
    bare = tmp_path / "base"
    shutil.copytree(folder, bare)
    base = ModernBertModel.from_pretrained(folder, attn_implementation="eager").eval()
    base.save_pretrained(bare)
    opened = open_model(bare, read_config(bare))
    assert opened.prefix == "" and head_weights(opened, 1, 0).sources["b_V"] == "layers.1.attn.Wqkv.bias[64:72]"
    _every_head_equals_eager(bare, base)


def test_dumped_slices_are_wqkvs_thirds(tiny):
    folder, model = tiny
    opened = open_model(folder, read_config(folder))
    assert opened.prefix == "model."
    for layer in range(4):
        attn = model.model.layers[layer].attn
        q, k, v = attn.Wqkv.weight.chunk(3)
        for head in range(4):
            rows = slice(head * 8, head * 8 + 8)
            weights = head_weights(opened, layer, head).as_torch()
            expected = {"W_Q": q[rows], "W_K": k[rows], "W_V": v[rows], "W_O": attn.Wo.weight[:, rows]}
            assert list(weights) == list(expected)
            for name, tensor in expected.items():
                torch.testing.assert_close(weights[name], tensor.detach(), rtol=0, atol=0)
    dumped = head_weights(opened, 2, 3)
    assert dumped.sources == {"W_Q": "model.layers.2.attn.Wqkv.weight[24:32, :]",
                              "W_K": "model.layers.2.attn.Wqkv.weight[56:64, :]",
                              "W_V": "model.layers.2.attn.Wqkv.weight[88:96, :]",
                              "W_O": "model.layers.2.attn.Wo.weight[:, 24:32]"}
    assert "head 3 is rows 24:32 of each (24, 56 and 88 onwards)" in dumped.notes[0]


@pytest.mark.parametrize(("layer", "local", "base"), [(0, False, 160000), (1, True, 10000), (2, True, 10000),
                                                      (3, False, 160000)])
def test_global_and_local_layers(tiny, layer, local, base):
    result = run_head(HeadOptions(model=str(tiny[0]), layer=layer, head=1, text=SENTENCE))
    spec = result.run.spec
    assert spec.align is None and spec.rope.base == base
    assert (spec.window, spec.window_side) == ((4, "both") if local else (None, "left"))
    n = result.attention.shape[0]
    assert n > 2 * REACH + 1
    far = torch.ones(n, n, dtype=torch.bool).triu(REACH + 1) | torch.ones(n, n, dtype=torch.bool).tril(-REACH - 1)
    assert bool((result.attention[far] == 0).all()) == local
    names = [step.name for step in result.run.layer.steps]
    assert names[:11] == ["X", "Q_feat", "K_feat", "V_feat", "Q_split", "K_split", "V_split", "cos", "sin",
                          "Q_rot", "K_rot"]
    assert ("masked_scores" in names) == local and "K_rep" not in names
    if local:
        assert result.run.layer.step("masked_scores").op == "scores.masked_fill(~window(4, both sides), -inf)"
    assert result.run.layer.step("X").op.startswith("the embeddings" if layer == 0 else "attn_norm(h)")


def test_4_4x_config_form(tiny, tmp_path):
    """global_attn_every_n_layers, global_rope_theta and local_rope_theta, no layer_types or rope_parameters: as
    transformers 4.4x saved ModernBERT (and as the Hub's answerdotai/ModernBERT-base config reads)."""
    from transformers import ModernBertForMaskedLM

    older = {"global_attn_every_n_layers": 2, "global_rope_theta": 80000.0, "local_rope_theta": 5000.0}
    folder = with_config(tiny[0], tmp_path / "old", lambda config: {
        k: v for k, v in config.items() if k not in ("layer_types", "rope_parameters")} | older)
    reference = ModernBertForMaskedLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert reference.config.layer_types == ["full_attention", "sliding_attention"] * 2
    _, attentions, _ = _eager(reference, folder)
    for layer in range(4):
        result = run_head(HeadOptions(model=str(folder), layer=layer, head=2, text=SENTENCE))
        torch.testing.assert_close(result.attention, attentions[layer][0, 2], atol=1e-5, rtol=1e-5)
        assert result.run.spec.rope.base == (5000.0 if layer % 2 else 80000.0)


def test_bert_command_takes_it_and_json_says_the_window(runner, tiny):
    result = runner.invoke(app, ["bert", "--model", str(tiny[0]), "--layer", "1", "--head", "0", "--text", SENTENCE,
                                 "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["command"] == "bert" and payload["model"]["model_type"] == "modernbert"
    attention = payload["layer_attention"]
    assert (attention["causal"], attention["window"], attention["window_side"], attention["sinks"]) == \
        (False, 4, "both", False)
    assert payload["tokens"][0] == "[CLS]" and payload["tokens"][-1] == "[SEP]"
    table = runner.invoke(app, ["bert", "--model", str(tiny[0]), "--layer", "1", "--head", "0", "--text", SENTENCE])
    assert "sliding window 4 both sides (|i − j| ≤ 2)" in table.stdout


@pytest.mark.parametrize(("edit", "message"), [
    ({"layer_types": ["full_attention", "chunked_attention", "sliding_attention", "full_attention"]},
     "layer_types[1] is 'chunked_attention'"),
    ({"num_attention_heads": 5}, "hidden_size 32 is not divisible by num_attention_heads 5"),
    ({"local_attention": 0}, "local_attention is 0"),
])
def test_bad_configs_are_one_line(runner, tiny, tmp_path, edit, message):
    refuses_config(runner, tiny[0], tmp_path / "bad", edit, message)
