"""The self-check of a trace through transformers' attention interface (models/selfcheck.py): a layer whose module
does something its attention function is not handed falls back to eager's pattern, never `traced`, with a note
naming the step that could not be reproduced. Planted: a LLaMA attention that windows its keys only under eager
(the interface sees a causal mask: step 'attention'), and one that scales its output only under eager (step
'out'); and the real case, DeepSeek-V3.2, whose indexer's choice reaches eager's mask but only a keyword of any
other attention function. The reference is transformers' eager model with the same module, output_attentions."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from tiny_encdec import save_random
from tiny_models import SENTENCE, _tokenizer

from attnscope.models.config import read_config
from attnscope.models.nopage import truncated
from attnscope.models.tokenizer import encode
from attnscope.runs.head_result import HeadOptions
from attnscope.runs.interface import run_transformers

WINDOW = 3


def _windowed(original):
    """LlamaAttention.forward, with keys WINDOW or more positions back hidden only when eager runs it."""
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        if self.config._attn_implementation == "eager" and attention_mask is not None:
            n_Q, n_K = attention_mask.shape[-2:]
            far = torch.ones(n_Q, n_K, dtype=torch.bool).tril(n_K - n_Q - WINDOW)  # [n_Q, n_K]
            attention_mask = attention_mask.masked_fill(far, torch.finfo(attention_mask.dtype).min)
        return original(self, hidden_states, position_embeddings, attention_mask, **kwargs)
    return forward


def _scaled(original):
    """LlamaAttention.forward, its output times 1.5 only when eager runs it."""
    def forward(self, *args, **kwargs):
        out, weights = original(self, *args, **kwargs)
        return (out * 1.5 if self.config._attn_implementation == "eager" else out), weights
    return forward


PLANTS = {"window": _windowed, "scale": _scaled}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    import transformers as tf

    folder = tmp_path_factory.mktemp("llama")
    tokenizer = _tokenizer("llama")
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(5)
    save_random(tf.LlamaForCausalLM(config), tokenizer, folder)
    return folder


def _plant(monkeypatch, name: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaAttention

    monkeypatch.setattr(LlamaAttention, "forward", PLANTS[name](LlamaAttention.forward))


def _eager(folder: Path):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def _run(folder: Path, **options):
    asked = HeadOptions(model=str(folder), layer=1, head=1, text=SENTENCE, **options)
    return run_transformers(asked, folder, read_config(folder), lambda message: nullcontext())


def test_unplanted_stays_traced(llama):
    run = truncated.run(llama, encode(llama, SENTENCE).ids, "llama", 1)
    assert run.recorded is not None and run.fallback == ""


@pytest.mark.parametrize(("plant", "step"), [("window", "attention"), ("scale", "out")])
def test_planted_module_falls_back(llama, monkeypatch, plant, step):
    _plant(monkeypatch, plant)
    ids = encode(llama, SENTENCE).ids
    with torch.no_grad():
        expected = _eager(llama)(torch.tensor([ids]), output_attentions=True).attentions[1][0]
    result = _run(llama)
    assert not result.traced and result.run is None
    assert any(f"the step '{step}' could not be reproduced" in note for note in result.notes), result.notes
    assert torch.allclose(result.all_heads, expected, atol=1e-6)


def test_planted_every_layer_and_generate(llama, monkeypatch):
    _plant(monkeypatch, "window")
    ids = encode(llama, SENTENCE).ids
    model = _eager(llama)
    with torch.no_grad():
        attentions = model(torch.tensor([ids]), output_attentions=True).attentions
        generated = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False, min_new_tokens=3)
    every = _run(llama, all_layers=True)
    assert not every.traced
    for layer in range(3):
        assert torch.allclose(every.layer_patterns[layer], attentions[layer][0], atol=1e-6)
    decoded = _run(llama, generate=3)
    assert [step.token_id for step in decoded.decode] == generated[0, len(ids):].tolist()
    for step in decoded.decode:
        with torch.no_grad():
            row = model(generated[:, : step.position], output_attentions=True).attentions[1][0, :, -1]
        assert torch.allclose(step.attention, row, atol=1e-6)
        assert bool((row[:, : step.position - WINDOW] == 0).all())  # the planted window, seen


def test_deepseek_v32_through_the_interface_is_not_traced(tmp_path):
    """The interface hands a DSA layer no selection: the pattern it would show is dense, and wrong."""
    from tiny_indexer import build

    model = build(tmp_path, "v32")
    ids = encode(tmp_path, SENTENCE).ids
    with torch.no_grad():
        expected = model(torch.tensor([ids]), output_attentions=True).attentions
    for layer in (0, 2):
        run = truncated.run(tmp_path, ids, "deepseek_v32", layer)
        assert run.recorded is None and "the step 'attention' could not be reproduced" in run.fallback
        assert torch.allclose(run.attention, expected[layer][0], atol=1e-6)


def test_planted_page_step_falls_back(tmp_path, monkeypatch):
    """A page whose module changes x_raw after recording it (a step the trace does not show): not traced, the
    note names x_raw, the pattern still shown."""
    import tiny_models

    from attnscope.attention.multihead import MultiHeadAttention
    from attnscope.runs.head import model_head

    tiny_models.build("llama", tmp_path)
    original = MultiHeadAttention.forward

    def forward(self, *args, **kwargs):
        trace = original(self, *args, **kwargs)
        if "x_raw" in trace:
            trace["x_raw"].mul_(1.5)
        return trace

    monkeypatch.setattr(MultiHeadAttention, "forward", forward)
    result = model_head(tmp_path, 1, 0, text=SENTENCE)
    assert not result.traced and result.attention is not None
    assert any("the step 'x_raw'" in note for note in result.notes), result.notes


def test_planted_decode_step_falls_back(tmp_path, monkeypatch):
    """The same, changed only on decode steps (one query): the prompt's layer reproduces, a step does not."""
    import tiny_models

    from attnscope.attention.multihead import MultiHeadAttention
    from attnscope.runs.head import run_head

    tiny_models.build("llama", tmp_path)
    original = MultiHeadAttention.forward

    def forward(self, *args, **kwargs):
        trace = original(self, *args, **kwargs)
        if "x_raw" in trace and trace["x_raw"].shape[-2] == 1:
            trace["x_raw"].mul_(1.5)
        return trace

    monkeypatch.setattr(MultiHeadAttention, "forward", forward)
    result = run_head(HeadOptions(model=str(tmp_path), layer=1, head=0, text=SENTENCE, generate=2))
    assert not result.traced and len(result.decode) == 2
    assert sum("the step 'x_raw'" in note for note in result.notes) == 1, result.notes
