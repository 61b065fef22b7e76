"""Families attnscope has no page for, traced through transformers' attention interface (models/nopage/interface.py):
every layer of tiny GPT-NeoX, Cohere2, Granite, Mixtral, VaultGemma, GraniteSWA and ELECTRA against transformers'
eager `output_attentions` (causal, sliding, softcapped, sinks, bidirectional layers), the recorded steps against
transformers' own `repeat_kv` and eager function, the mask's kind against transformers' own mask functions, the
truncated load, and Falcon (whose attention does not call the interface) shown untraced."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_encdec import save_random
from tiny_interface import FAMILIES, build
from tiny_models import SENTENCE, _tokenizer


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model, tokenizer = build(request.param, folder)
    encoded = tokenizer(SENTENCE, return_tensors="pt")
    with torch.no_grad():
        expected = model(**encoded, output_attentions=True).attentions
    return request.param, folder, model, expected


def _head(folder, layer, head, **more):
    from attnscope.runs.head import HeadOptions, run_head

    return run_head(HeadOptions(model=str(folder), layer=layer, head=head, text=SENTENCE, **more))


def test_every_layer_is_traced_and_equals_eager(family):
    name, folder, model, expected = family
    kinds = getattr(model.config, "layer_types", None)
    for layer in range(len(expected)):
        head = (layer + 1) % expected[layer].shape[1]
        result = _head(folder, layer, head)
        assert result.traced and result.tracer == "attention-interface"
        torch.testing.assert_close(result.all_heads, expected[layer][0], atol=1e-5, rtol=0)  # every head
        torch.testing.assert_close(result.attention, expected[layer][0, head], atol=1e-5, rtol=0)
        trace = result.run.layer
        assert [s.name for s in trace.steps][:3] == ["Q", "K", "V"]
        assert not any("differ" in note for note in trace.notes), trace.notes
        mask = trace.step("mask").op if "mask" in trace else "no mask"
        sliding = kinds is not None and kinds[layer] == "sliding_attention" or name == "mixtral"
        if name == "electra":
            assert "mask" not in trace or "(bidirectional)" in mask
        elif sliding:
            assert "(sliding window 4)" in mask and result.run.spec.window == 4
        else:
            assert "(causal)" in mask and result.run.spec.window is None


def test_the_steps_are_transformers_own(family):
    """K_rep as transformers' repeat_kv; scores with the module's own scaling; out as the eager function's."""
    from transformers.models.llama.modeling_llama import repeat_kv

    name, folder, model, _ = family
    trace = _head(folder, 1, 0).run.layer
    n_head, n_kv = trace["Q"].shape[1], trace["K"].shape[1]
    if n_kv != n_head:
        torch.testing.assert_close(trace["K_rep"], repeat_kv(trace["K"], n_head // n_kv))
        torch.testing.assert_close(trace["V_rep"], repeat_kv(trace["V"], n_head // n_kv))
    attention_module = next(m for n, m in model.named_modules() if n.endswith("1.attention.self") or
                            n.endswith("layers.1.self_attn") or n.endswith("layers.1.attention"))
    scaling = getattr(attention_module, "scaling", trace["Q"].shape[-1] ** -0.5)
    k = trace["K_rep"] if "K_rep" in trace else trace["K"]
    torch.testing.assert_close(trace["scores"], trace["Q"] @ k.transpose(2, 3) * scaling)
    if name == "vaultgemma":
        assert trace.step("capped_scores").op == "3 * tanh(scores / 3)"
    if name == "granite_swa":
        assert "(attention @ V_rep) * (1 - sink_weight)" == trace.step("out").op
        assert trace["sinks"].shape == (n_head,)
        torch.testing.assert_close(trace["attention"].sum(-1), torch.ones(trace["attention"].shape[:-1]))


def test_head_json_steps_and_save(family, runner, tmp_path):
    from attnscope.cli import app
    from attnscope.tensors import load_tensor

    _, folder, _, expected = family
    saved = tmp_path / "head.safetensors"
    result = runner.invoke(app, ["head", "--model", str(folder), "--layer", "1", "--head", "2", "--text", SENTENCE,
                                 "--json", "--all-heads", "--save", str(saved)])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["traced"] is True and payload["tracer"] == "attention-interface"
    assert payload["tensors"] == [] and payload["layer_steps"][0]["dims"] == ["n_batch", "n_head", "n_tokens",
                                                                                "d_head"]
    assert [s["name"] for s in payload["steps"]][:3] == ["Q", "K", "V"]
    assert len(payload["heads"]) == expected[1].shape[1]
    torch.testing.assert_close(load_tensor(f"{saved}:attention"), expected[1][0, 2], atol=1e-5, rtol=0)
    assert any("not traced" in note for note in payload["notes"])


def test_only_the_layers_up_to_l_are_built_and_run(tmp_path, monkeypatch):
    from attnscope.models.nopage import interface, truncated

    model, _ = build("cohere2", tmp_path / "cohere2")
    full, n_layer = truncated.full_config(tmp_path / "cohere2", "cohere2", 1)
    config = truncated.cut(full, n_layer, 1)
    assert n_layer == 4 and config.num_hidden_layers == 2
    assert config.layer_types == ["sliding_attention", "sliding_attention"]
    calls = []
    original = interface.eager_function
    monkeypatch.setattr(interface, "eager_function", lambda module: calls.append(module.layer_idx) or original(module))
    built = []
    from transformers import AutoModel

    load = AutoModel.from_pretrained
    monkeypatch.setattr(AutoModel, "from_pretrained", lambda *a, **k: built.append(k["config"].num_hidden_layers)
                        or load(*a, **k))
    truncated.run(tmp_path / "cohere2", [5, 6, 7, 8, 9, 10], "cohere2", 1)
    assert built == [2] and calls == [0, 1]  # two layers built, and the model stopped after layer 1's attention


def test_a_family_that_does_not_call_the_interface_shows_eager_untraced(tmp_path, runner):
    import transformers as tf

    from attnscope.cli import app

    tokenizer = _tokenizer("gpt2")
    config = tf.FalconConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                             new_decoder_architecture=True, num_kv_heads=2, alibi=True)  # families/falcon.py: no page
    torch.manual_seed(0)
    eager = save_random(tf.FalconForCausalLM(config), tokenizer, tmp_path / "falcon")
    with torch.no_grad():
        expected = eager(**tokenizer(SENTENCE, return_tensors="pt"), output_attentions=True).attentions[1][0, 3]
    result = runner.invoke(app, ["head", "--model", str(tmp_path / "falcon"), "--layer", "1", "--head", "3",
                                 "--text", SENTENCE, "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["traced"] is False and payload["tracer"] is None and payload["steps"] == []
    assert "not through transformers' attention interface" in payload["notes"][0]
    torch.testing.assert_close(torch.tensor(payload["attention"]), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("rule", "size", "kind"), [
    ("causal", None, "causal"), ("sliding", 3, "sliding"), ("chunked", 4, "chunked"),
    ("bidirectional", None, "bidirectional"), ("bidirectional sliding", 2, "bidirectional sliding")])
def test_the_mask_kind_is_read_from_transformers_own_masks(rule, size, kind):
    """Masks made by transformers' masking_utils (eager_mask over its own mask functions), read back."""
    from transformers import masking_utils as mu

    from attnscope.models.nopage.mask_kind import allowed_pairs, read_mask

    functions = {"causal": mu.causal_mask_function, "bidirectional": mu.bidirectional_mask_function,
                 "sliding": mu.sliding_window_causal_mask_function(size) if size else None,
                 "chunked": mu.chunked_causal_mask_function(size, torch.zeros(1, dtype=torch.long)) if size else None,
                 "bidirectional sliding": mu.sliding_window_bidirectional_mask_function(size) if size else None}
    mask = mu.eager_mask(batch_size=1, q_length=11, kv_length=11, mask_function=functions[rule])
    found = read_mask(allowed_pairs(mask, 11, 11))
    assert found.kind == kind
    if rule in ("sliding", "chunked"):
        assert found.size == size
