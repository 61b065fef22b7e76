"""`--generate` on the qk-norm families (Llama 4 text and multimodal, Qwen3, Qwen3-MoE, Gemma 3 text and
multimodal, OLMo 2) against transformers' own `generate` on the same tiny checkpoints: the greedy ids, each
step's attention row of every layer (`generate(output_attentions=True)`'s last query row), the keys a sliding
window or a chunk let go, and the KV cache's bytes as transformers' `DynamicCache` holds them.

Llama 4 norms q and k after RoPE (`Llama4TextL2Norm`) before `past_key_values.update`, so its cache holds
normed keys and only the new tokens' are normed; attnscope once refused a cache there. Its chunked layers are
cached as sliding windows of `attention_chunk_size` (transformers' `DynamicSlidingWindowLayer`)."""

from __future__ import annotations

import pytest
import torch
from tiny_llama4_smollm3_phi3 import build as build_llama4
from tiny_models import cached_builder
from tiny_qknorm_models import build as build_qknorm

from attnscope.models import tokenizer
from attnscope.models.config import read_config
from attnscope.models.families import open_model
from attnscope.models.forward.stream import generate
from attnscope.models.nopage.cache_names import cache_of

FAMILIES = ["llama4", "llama4_mm", "qwen3", "qwen3_moe", "gemma3_text", "gemma3", "olmo2"]


def _build(family: str, folder):
    return (build_llama4 if family.startswith("llama4") else build_qknorm)(family, folder)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return cached_builder(tmp_path_factory, _build)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_equals_transformers_generate(tiny, family):
    folder, reference = tiny(family)
    ids = tokenizer.encode(folder, "The cat sat on the mat").ids
    model = open_model(folder, read_config(folder))
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=5, min_new_tokens=5, do_sample=False,
                                 output_attentions=True, return_dict_in_generate=True)
    for layer in (0, 1):  # every kind of layer these tiny models have (full, sliding or chunked; NoPE; MoE)
        with model.checkpoint:
            steps = generate(model, ids, 5, layer)
        assert [s.token_id for s in steps] == out.sequences[0, len(ids):].tolist()
        for t, step in enumerate(steps):
            theirs = out.attentions[t][layer][0, :, -1]  # [n_head, keys the cache kept]
            kept = theirs.shape[-1]
            torch.testing.assert_close(step.attention[:, -kept:], theirs, atol=1e-5, rtol=0)
            if t:  # a decode step: the cache holds only what the window (or chunk) keeps
                assert step.evicted == step.attention.shape[-1] - kept, (layer, t)
            assert not bool(step.attention[:, : step.evicted].any())
    held = sum(tensor.numel() * tensor.element_size() for layer_cache in cache_of(out).layers
               for tensor in (layer_cache.keys, layer_cache.values))
    assert steps[-1].kv_cache_bytes == held


def test_llama4_cli_generate_runs(tiny, runner):
    from attnscope.cli import app

    folder, _ = tiny("llama4")
    result = runner.invoke(app, ["head", "--model", str(folder), "--layer", "0", "--text", "The cat sat on",
                                 "--generate", "3"])
    assert result.exit_code == 0, result.output
    assert "generated 3 tokens greedily" in result.stdout
