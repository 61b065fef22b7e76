"""The self-check on Qwen2.5-VL and Qwen3-VL (models/vision/vlm_run.py `interface`, vlm_generate.py
`through_interface`): their text model runs through transformers' attention interface, and the traced layer is held
against its module's own eager run (nopage/interface_check.py) on the prompt and at every decode step. Unplanted:
checked (selfcheck.check counted), no self-check note, traced, equal to eager's output_attentions and to generate's ids
and rows. Planted as tests/test_selfcheck.py plants them, in the text attention module: a key hidden only under eager
(step 'attention'), the output scaled only under eager (step 'out'), and the output scaled only on one-token decode
steps (the prompt reproduces, a step does not): caught, the run falls back to eager's output_attentions, untraced, with
the self-check's note, equal to the planted eager model's pattern, ids and rows. The reference is transformers' eager
VLM (tests/tiny_vlm.py) with the same plant."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from cli_main import run_main
from test_selfcheck import _counted
from tiny_models import cached_builder
from tiny_vlm import TEXT, build, image, reference_inputs

from attnscope.runs.head_result import HeadOptions

NAMES = ("qwen2_5_vl", "qwen3_vl")
MODULES = {"qwen2_5_vl": "Qwen2_5_VLAttention", "qwen3_vl": "Qwen3VLTextAttention"}  # the text model's attention
N_NEW = 3
LAYER = 1


def _hidden_first_key(original):
    """The text attention's forward with key 0 hidden (from every query but the first) only when eager runs it."""
    def forward(self, *args, **kwargs):
        mask = kwargs.get("attention_mask")
        if self.config._attn_implementation == "eager" and mask is not None:
            n_Q, n_K = mask.shape[-2:]
            hide = torch.zeros(n_Q, n_K, dtype=torch.bool)  # [n_Q, n_K]
            hide[:, 0] = True
            hide[0, 0] = n_Q != n_K  # the prompt's first query keeps the one key it has
            kwargs["attention_mask"] = mask.masked_fill(hide, torch.finfo(mask.dtype).min)
        return original(self, *args, **kwargs)
    return forward


def _scaled(original, decode_only: bool = False):
    """Its output times 1.5 only when eager runs it (with `decode_only`, on a one-token decode step only)."""
    def forward(self, *args, **kwargs):
        out, weights = original(self, *args, **kwargs)
        one = kwargs["hidden_states"].shape[1] == 1
        planted = self.config._attn_implementation == "eager" and (one or not decode_only)
        return (out * 1.5 if planted else out), weights
    return forward


PLANTS = {"hide": (_hidden_first_key, "attention"), "scale": (_scaled, "out"),
          "scale_decode": (lambda f: _scaled(f, decode_only=True), "out")}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return cached_builder(tmp_path_factory, build)


@pytest.fixture(scope="module")
def picture(tmp_path_factory) -> Path:
    return image(tmp_path_factory.mktemp("picture") / "cat.png")


def _plant(monkeypatch, name: str, plant: str) -> str:
    """`plant` in `name`'s text attention class; the step its note must name."""
    cls = getattr(importlib.import_module(f"transformers.models.{name}.modeling_{name}"), MODULES[name])
    wrap, step = PLANTS[plant]
    monkeypatch.setattr(cls, "forward", wrap(cls.forward))
    return step


def _reference(model, folder: Path, picture: Path):
    """The eager VLM (with whatever is planted) on the processor's inputs: every layer's output_attentions, and
    greedy decoding (`generate`, no processor, no end-of-text stop): the new ids and each step's attentions."""
    from transformers import GenerationConfig

    inputs = reference_inputs(model, folder, TEXT, picture)
    model.generation_config = GenerationConfig()
    with torch.no_grad():
        attentions = model(**inputs, output_attentions=True).attentions
        out = model.generate(**inputs, generation_config=GenerationConfig(
            do_sample=False, max_new_tokens=N_NEW, eos_token_id=None, output_attentions=True,
            return_dict_in_generate=True))
    return attentions, out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), out.attentions


def _run(folder: Path, picture: Path, **more):
    from attnscope.runs.head import run_head

    return run_head(HeadOptions(model=str(folder), layer=LAYER, head=1, text=TEXT, image=str(picture), **more))


def _self_notes(result) -> list[str]:
    return [note for note in result.notes if "self-check" in note]


def _same_decoding(result, ids: list[int], attentions) -> None:
    assert [step.token_id for step in result.decode] == ids
    for t, step in enumerate(result.decode):
        row = attentions[t][LAYER][0, :, -1]  # [n_head, keys the cache holds]
        torch.testing.assert_close(step.attention[:, -row.shape[-1]:], row, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_unplanted_is_checked_and_traced(built, picture, monkeypatch, name):
    folder, model = built(name)
    attentions, ids, steps = _reference(model, folder, picture)
    checked = _counted(monkeypatch)
    short = _run(folder, picture)
    assert short.traced and short.tracer == "attention-interface" and not _self_notes(short), short.notes
    assert checked == [LAYER]
    torch.testing.assert_close(short.all_heads, attentions[LAYER][0], atol=1e-5, rtol=0)
    checked.clear()
    every = _run(folder, picture, all_layers=True)
    assert every.traced and not _self_notes(every) and checked == list(range(len(attentions)))
    checked.clear()
    decoded = _run(folder, picture, generate=N_NEW)
    assert decoded.traced and not _self_notes(decoded), decoded.notes
    assert checked == [LAYER] * N_NEW  # the prompt's forward and each step's but the last, which chose no token
    said = f"layer {LAYER}'s module output checked against its own eager run on the prompt and at each new token"
    assert any(said in note for note in decoded.notes), decoded.notes
    _same_decoding(decoded, ids, steps)


@pytest.mark.parametrize("plant", ["hide", "scale"])
@pytest.mark.parametrize("name", NAMES)
def test_planted_prompt_falls_back(built, picture, monkeypatch, name, plant):
    """Layer L's module not reproduced on the prompt: the short view, every layer and decoding all show eager's
    (planted) patterns, untraced, with the note naming the layer and the step."""
    folder, model = built(name)
    step = _plant(monkeypatch, name, plant)
    attentions, ids, steps = _reference(model, folder, picture)
    for more in ({}, {"all_layers": True}, {"generate": N_NEW}):
        result = _run(folder, picture, **more)
        assert not result.traced and result.run is None, more
        (note,) = _self_notes(result)
        assert f"self-check: layer {0 if more.get('all_layers') else LAYER}'s module" in note, note
        assert f"the step '{step}' could not be reproduced" in note, note
        assert not [note for note in result.notes if "traced through" in note], result.notes
        torch.testing.assert_close(result.all_heads, attentions[LAYER][0], atol=1e-5, rtol=0)
        if more.get("all_layers"):
            for mine, theirs in zip(result.layer_patterns, attentions, strict=True):
                torch.testing.assert_close(mine, theirs[0], atol=1e-5, rtol=0)
        if more.get("generate"):
            _same_decoding(result, ids, steps)
    if plant == "hide":
        assert bool((attentions[LAYER][0][:, 1:, 0] == 0).all())  # the planted mask, seen


@pytest.mark.parametrize("name", NAMES)
def test_planted_decode_step_falls_back(built, picture, monkeypatch, name):
    """The prompt reproduces, a one-token step does not: the decoding falls back to eager's, untraced."""
    folder, model = built(name)
    _plant(monkeypatch, name, "scale_decode")
    attentions, ids, steps = _reference(model, folder, picture)
    assert _run(folder, picture).traced  # the prompt alone is reproduced
    result = _run(folder, picture, generate=N_NEW)
    assert not result.traced
    (note,) = _self_notes(result)
    assert f"self-check: layer {LAYER}'s module" in note and "the step 'out' could not be reproduced" in note, note
    torch.testing.assert_close(result.all_heads, attentions[LAYER][0], atol=1e-5, rtol=0)
    _same_decoding(result, ids, steps)


def test_planted_on_the_command_line(built, picture, monkeypatch):
    """--generate --json --check on a planted Qwen2.5-VL: exit 0, traced false, the note, --check passes against
    the same eager model."""
    folder, model = built("qwen2_5_vl")
    _plant(monkeypatch, "qwen2_5_vl", "hide")
    _, ids, _ = _reference(model, folder, picture)
    out = run_main("head", "--model", str(folder), "--text", TEXT, "--image", str(picture), "--layer", str(LAYER),
                   "--generate", "2", "--json", "--check")
    assert out.code == 0, out.stderr
    data = out.json()
    assert data["traced"] is False and data["check_passed"] is True, data["check"]
    assert any(f"self-check: layer {LAYER}'s module" in note for note in data["notes"]), data["notes"]
    assert [step["token_id"] for step in data["decode_steps"]] == ids[:2]
