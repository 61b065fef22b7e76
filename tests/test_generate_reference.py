"""--generate N --check decodes the reference by attnscope's rule (nopage/eager.py's `greedy_config`): N tokens, each
the argmax of the last logits, no stop at the end-of-text token, none of the processors a checkpoint's
generation_config.json asks for. Each folder here carries a repetition_penalty, a no_repeat_ngram_size and a
min_new_tokens (with the end-of-text token set to one the argmax picks) that would each change transformers'
`generate` (held here first, so the test cannot pass by a model that ignores them); the reference is a hand-written
loop over transformers' eager logits, the whole sequence run again for each token (no cache): `--check` passes
and the ids equal the loop's, for a text (LLaMA, attnscope's page) and for an image (Qwen2.5-VL through the
attention interface, LLaVA on its page)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_main import run_main
from tiny_models import SENTENCE, cached_builder
from tiny_models import build as build_text
from tiny_vlm import TEXT, image, reference_inputs
from tiny_vlm import build as build_vlm

from attnscope.models.tokenizer import encode

N_NEW = 5


def _loop(model, inputs: dict, n_new: int) -> list[int]:
    """The reference: `model(**inputs).logits[0, -1].argmax()`, appended, `n_new` times, every token's forward
    over the whole sequence (each per-token input, the mask and Qwen's mm_token_type_ids, grown by one)."""
    inputs = dict(inputs)
    n = inputs["input_ids"].shape[1]
    new: list[int] = []
    with torch.no_grad():
        for _ in range(n_new):
            new.append(int(model(**inputs).logits[0, -1].argmax()))
            for name, value in list(inputs.items()):
                if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == (1, n + len(new) - 1):
                    grown = new[-1] if name == "input_ids" else int(name == "attention_mask")
                    inputs[name] = torch.cat([value, value.new_tensor([[grown]])], dim=1)  # [1, n] -> [1, n + 1]
    return new


SETTINGS = ({"repetition_penalty": 1.5}, {"no_repeat_ngram_size": 2}, {"min_new_tokens": N_NEW})


def _plant(folder: Path, model, inputs: dict, loop: list[int]) -> None:
    """Each setting changes transformers' ids on its own (min_new_tokens with the end-of-text token set to the
    loop's first: it would be hidden); then all of them written to the folder's generation_config.json, which
    generate reads (held too)."""
    from transformers import GenerationConfig

    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        for setting in SETTINGS:
            model.generation_config = GenerationConfig(eos_token_id=loop[0], **setting)
            out = model.generate(**inputs, max_new_tokens=N_NEW, do_sample=False)
            assert out[0, n:].tolist() != loop, f"{setting} does not change the ids: the test would prove nothing"
    merged = {key: value for setting in SETTINGS for key, value in setting.items()}
    (folder / "generation_config.json").write_text(json.dumps({**merged, "eos_token_id": loop[0]}))
    read = type(model).from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        assert read.generate(**inputs, max_new_tokens=N_NEW)[0, n:].tolist() != loop


def _checked(*args: str) -> dict:
    out = run_main("head", *args, "--generate", str(N_NEW), "--check", "--json")
    assert out.code == 0, out.stderr
    data = out.json()
    assert data["check_passed"] is True, data["check"]
    assert any(c["name"] == "generated ids" for c in data["check"])
    return data


def test_text_generate_check_ignores_the_folders_processors(tmp_path):
    folder = tmp_path / "llama"
    model = build_text("llama", folder)
    inputs = {"input_ids": torch.tensor([encode(folder, SENTENCE).ids])}
    loop = _loop(model, inputs, N_NEW)
    _plant(folder, model, inputs, loop)
    data = _checked("--model", str(folder), "--text", SENTENCE, "--layer", "1")
    assert [step["token_id"] for step in data["decode_steps"]] == loop


@pytest.fixture(scope="module")
def vlms(tmp_path_factory):
    return cached_builder(tmp_path_factory, build_vlm)


@pytest.mark.parametrize("name", ["qwen2_5_vl", "llava"])
def test_vlm_generate_check_ignores_the_folders_processors(vlms, tmp_path, name):
    folder, model = vlms(name)
    picture = image(tmp_path / "cat.png")
    inputs = reference_inputs(model, folder, TEXT, picture)
    loop = _loop(model, inputs, N_NEW)
    _plant(folder, model, inputs, loop)
    data = _checked("--model", str(folder), "--text", TEXT, "--image", str(picture), "--layer", "1")
    assert data["token_ids"] == inputs["input_ids"][0].tolist()
    assert [step["token_id"] for step in data["decode_steps"]] == loop
