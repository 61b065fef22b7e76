"""`head --check` on a multimodal Gemma 3 or Gemma 4 folder (Gemma*ForConditionalGeneration, run on a text): the
text model's layers live in the config's text_config, which the reference loader now reads (truncated.full_config
with text=True, `layers_config`), and transformers' eager multimodal model is the reference. Every layer PASSes,
each equal to that model's own output_attentions computed here; a mistake planted in attnscope's forward FAILs;
--generate's ids and rows are held against transformers' generate."""

from __future__ import annotations

import pytest
import torch
from cli_main import run_main
from tiny_models import SENTENCE

from attnscope.models import tokenizer

BUILDERS = {"gemma3": "tiny_vlm", "gemma4": "tiny_gemma4"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (folder, transformers' eager Gemma*ForConditionalGeneration read back from it)."""
    import importlib

    from tiny_models import cached_builder

    return cached_builder(tmp_path_factory, lambda name, folder: importlib.import_module(BUILDERS[name]).build(
        name, folder))


def _eager(folder, model, text: str) -> tuple:
    ids = tokenizer.encode(folder, text).ids
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), output_attentions=True).attentions


@pytest.mark.parametrize("name", list(BUILDERS))
def test_check_of_every_layer_passes_against_the_multimodal_eager_model(built, name):
    folder, model = built(name)
    assert "text_config" in model.config.to_dict() and not hasattr(model.config, "num_hidden_layers")
    attentions = _eager(folder, model, SENTENCE)
    n_layer = len(attentions)
    outcome = run_main("head", "--model", str(folder), "--text", SENTENCE, "--layer", "1", "--all-layers",
                       "--check", "--json")
    assert outcome.code == 0, outcome.stderr
    payload = outcome.json()
    assert {c["name"]: c["passed"] for c in payload["check"]} == {f"layer {i}": True for i in range(n_layer)}
    for entry in payload["all_layers"]:  # what was checked is what transformers' multimodal model computes
        torch.testing.assert_close(torch.tensor(entry["attention"]), attentions[entry["layer"]][0], atol=1e-5,
                                   rtol=0)
    one = run_main("head", "--model", str(folder), "--text", SENTENCE, "--layer", "2", "--check", "--json")
    assert one.code == 0, one.stderr
    assert [(c["name"], c["passed"]) for c in one.json()["check"]] == [("layer 2", True)]


@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_planted_mistake_in_a_multimodal_folder_fails(built, monkeypatch, name):
    """Layer 0's sliding window dropped from attnscope's forward: --check says FAIL for layer 0, exit 1."""
    from attnscope.models.families.gemma3 import Gemma3

    folder, _ = built(name)
    real = Gemma3.window
    monkeypatch.setattr(Gemma3, "window", lambda self, layer: None if layer == 0 else real(self, layer))
    outcome = run_main("head", "--model", str(folder), "--text", SENTENCE, "--layer", "0", "--check", "--json")
    assert outcome.code == 1
    assert [(c["name"], c["passed"]) for c in outcome.json()["check"]] == [("layer 0", False)]


@pytest.mark.parametrize("name", list(BUILDERS))
def test_generate_check_in_a_multimodal_folder(built, name):
    """The ids and each step's row of layer 2 against transformers' generate on the multimodal model (a text
    whose greedy tokens are no image token: generating one, the model would read it as an image's place)."""
    folder, model = built(name)
    ids = tokenizer.encode(folder, "The cat sat on the mat").ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert model.config.image_token_id not in out[0].tolist()
    outcome = run_main("head", "--model", str(folder), "--text", "The cat sat on the mat", "--layer", "2",
                       "--generate", "3", "--check", "--json")
    assert outcome.code == 0, outcome.stderr
    payload = outcome.json()
    assert [step["token_id"] for step in payload["decode_steps"]] == out[0, len(ids):].tolist()
    assert all(c["passed"] for c in payload["check"])
    assert {c["name"] for c in payload["check"]} >= {"generated ids", "step 0 layer 2", "step 2 layer 2"}
