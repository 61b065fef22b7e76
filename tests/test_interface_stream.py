"""`--all-layers` and `--generate` for families with no page, through transformers' own forward and cache with the
attention captured at every call (models/forward/interface_stream.py): the decode steps' evicted keys and cache bytes
against transformers' own cache, the memory guard before anything is loaded, the terminal views, and the
refusals (no language-model head, attention in the family's own code, --rows) in one line. The patterns
themselves are held against eager in tests/test_conformance.py's interface and hybrid rows."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_encdec import save_random
from tiny_interface import build
from tiny_models import SENTENCE, _tokenizer

from attnscope.cli import app
from attnscope.models.nopage.cache_names import cache_of

PROMPT = "The cat sat on"


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixtral")
    return folder, build("mixtral", folder)[0]


def _invoke(runner, folder, *args):
    return runner.invoke(app, ["head", "--model", str(folder), *args])


def test_decode_steps_evict_and_count_the_cache_as_transformers_does(mixtral, runner):
    """A window of 4: each step's row spans every position before the new token, the keys the sliding cache let go
    are evicted (zeros), and kv_cache_bytes is what transformers' DynamicCache holds after the step."""
    folder, eager = mixtral
    result = _invoke(runner, folder, "--text", PROMPT, "--layer", "1", "--generate", "4", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    ids, steps = payload["token_ids"], payload["decode_steps"]
    assert payload["traced"] is True and payload["tracer"] == "attention-interface"
    with torch.no_grad():
        out = eager.generate(torch.tensor([ids]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                             return_dict_in_generate=True)
    for t, step in enumerate(steps):
        assert step["position"] == len(ids) + t and len(step["attention"][0]) == step["position"]
        assert step["evicted"] == step["position"] - 4  # the window's first key
        row = torch.tensor(step["attention"])
        assert bool((row[:, : step["evicted"]] == 0).all())
        torch.testing.assert_close(row.sum(-1), torch.ones(row.shape[0]))
    cache = cache_of(out)  # after the last step (the prompt and 3 new tokens fed): a window keeps 3 keys
    held = sum(layer.keys.numel() * 4 * 2 for layer in cache.layers)
    assert steps[-1]["kv_cache_bytes"] == held
    assert any("DynamicCache" in note for note in payload["notes"])


def test_all_layers_and_generate_together_on_the_terminal(mixtral, runner):
    folder, _ = mixtral
    result = _invoke(runner, folder, "--text", SENTENCE, "--all-layers", "--generate", "3", "--layer", "1")
    assert result.exit_code == 0, result.output
    assert "every layer, every head  [2 layers x 4 heads" in result.stdout
    assert "generated 3 tokens greedily" in result.stdout and "KV cache after the last token" in result.stdout


def test_the_memory_guard_refuses_before_loading(mixtral, runner, monkeypatch):
    from attnscope.models.nopage import truncated

    folder, _ = mixtral
    monkeypatch.setattr(truncated, "load", lambda *a, **k: pytest.fail("loaded past the memory guard"))
    for more in (["--all-layers"], ["--generate", "2"]):
        result = _invoke(runner, folder, "--text", SENTENCE, *more, "--max-memory", "1MB")
        assert result.exit_code == 1, result.output
        assert "running every layer of this model through transformers" in result.stderr
        assert "more than --max-memory" in result.stderr and result.stderr.count("\n") == 1


def test_a_checkpoint_without_a_language_model_head_does_not_decode(tmp_path, runner):
    """ELECTRA saved as ElectraModel: transformers would give ElectraForCausalLM a random head."""
    build("electra", tmp_path / "electra")
    result = _invoke(runner, tmp_path / "electra", "--text", PROMPT, "--generate", "2")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("attnscope: error: --generate needs the model's language-model head")
    assert result.stderr.count("\n") == 1
    every = _invoke(runner, tmp_path / "electra", "--text", SENTENCE, "--all-layers", "--json")
    assert every.exit_code == 0, every.output  # every layer of an encoder is fine
    assert len(json.loads(every.stdout)["all_layers"]) == 2


def test_a_family_computing_its_own_attention_is_refused_beyond_one_layer(tmp_path, runner):
    import transformers as tf

    tokenizer = _tokenizer("gpt2")
    # Falcon with ALiBi: its page declines it (transformers 5 adds the bias twice), so transformers runs its own code
    config = tf.FalconConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             alibi=True)
    torch.manual_seed(0)
    save_random(tf.FalconForCausalLM(config), tokenizer, tmp_path / "falcon")
    for more in (["--all-layers"], ["--generate", "2"]):
        result = _invoke(runner, tmp_path / "falcon", "--text", PROMPT, *more)
        assert result.exit_code == 2, result.output
        assert "computes its attention in its own code" in result.stderr and result.stderr.count("\n") == 1


def test_rows_are_refused_without_a_page(mixtral, runner):
    folder, _ = mixtral
    result = _invoke(runner, folder, "--text", SENTENCE, "--rows", "0:2")
    assert result.exit_code == 2 and "drop --rows" in result.stderr and result.stderr.count("\n") == 1


def test_a_hybrid_layer_without_attention_is_refused_before_loading(tmp_path, runner, monkeypatch):
    from attnscope.models.nopage import truncated

    build("lfm2", tmp_path / "lfm2")
    monkeypatch.setattr(truncated, "load", lambda *a, **k: pytest.fail("loaded a layer with no attention"))
    result = _invoke(runner, tmp_path / "lfm2", "--text", PROMPT, "--layer", "2")
    assert result.exit_code == 2
    assert result.stderr == ("attnscope: error: --layer 2 of this Lfm2 model has no attention (a 'conv' layer); the "
                             "layers with attention are 1, 3\n")
