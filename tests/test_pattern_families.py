"""The pages of the families whose modeling code computes attention itself (BLOOM, MPT, GPT-J, Falcon in its three
layouts): every layer's every head traced and equal to transformers' eager `output_attentions` (float32, 1e-5),
decoding equal to `generate(output_attentions=True)`, each head's dumped weights the rows transformers' own split
gives it, and the checkpoints a page does not compute (Falcon with ALiBi, MPT with clip_qkv) left to transformers.
The matrix's views of one model per page are tests/test_conformance.py's; here, every layout."""

from __future__ import annotations

import pytest
import torch
from test_conformance import PROMPT, _close, _json
from tiny_models import SENTENCE, assert_every_head_dumped, cached_builder, with_config
from tiny_pattern_families import NAMES, build


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return cached_builder(tmp_path_factory, build)


@pytest.mark.parametrize("name", NAMES)
def test_every_layer_and_head_is_traced_as_eager(built, runner, name):
    folder, eager = built(name)
    for layer in range(eager.config.num_hidden_layers):
        payload = _json(runner, folder, "--text", SENTENCE, "--all-heads", "--layer", str(layer))
        assert payload["traced"] is True and payload["tracer"] == "attnscope"
        with torch.no_grad():
            theirs = eager(torch.tensor([payload["token_ids"]]), output_attentions=True).attentions[layer][0]
        for head in payload["heads"]:
            _close(head["attention"], theirs[head["head"]], f"{name} layer {layer} head {head['head']}")


@pytest.mark.parametrize("name", ["bloom_pre", "falcon_mq", "falcon_seq"])  # the matrix decodes the others
def test_decoding_is_generates(built, runner, name):
    folder, eager = built(name)
    layer = eager.config.num_hidden_layers - 1
    payload = _json(runner, folder, "--text", PROMPT, "--layer", str(layer), "--generate", "5")
    ids, steps = payload["token_ids"], payload["decode_steps"]
    with torch.no_grad():
        out = eager.generate(torch.tensor([ids]), max_new_tokens=5, min_new_tokens=5, do_sample=False,
                             output_attentions=True, return_dict_in_generate=True)
    assert [s["token_id"] for s in steps] == out.sequences[0, len(ids):].tolist()
    for t, step in enumerate(steps):
        theirs = out.attentions[t][layer][0, :, -1]  # [n_head, keys]
        _close(torch.tensor(step["attention"])[:, -theirs.shape[-1]:].tolist(), theirs, f"{name} step {t}")


def _split(name: str, attention, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V `[n_head, d_head, ...]` of a fused weight `[out, d_model]` (or bias `[out]`), split by the module's
    own code: its output axis fed through `_reshape` / `_split_heads` as if each input coordinate were a token."""
    rows = fused.T[None] if fused.dim() == 2 else fused[None, None]  # [1, d_model or 1, out]
    if name.startswith("bloom"):
        q, k, v = attention._reshape(rows)  # [1, n_head, d_model, d_head]
        return tuple(x[0].transpose(-1, -2) for x in (q, k, v))
    q, k, v = attention._split_heads(rows)  # [1, d_model, heads, d_head]; the new layout's K, V broadcast per head
    return tuple(x[0].permute(1, 2, 0) for x in (q, k, v))


def _expected_slices(name: str, model, layer: int, head: int) -> dict[str, torch.Tensor]:
    config = model.config
    d = config.hidden_size // config.num_attention_heads
    block = model.transformer.h[layer] if hasattr(model.transformer, "h") else model.transformer.blocks[layer]
    rows = slice(head * d, (head + 1) * d)
    if name == "gptj":
        attn = block.attn
        return {"W_Q": attn.q_proj.weight[rows], "W_K": attn.k_proj.weight[rows], "W_V": attn.v_proj.weight[rows],
                "W_O": attn.out_proj.weight[:, rows]}
    if name == "mpt":
        q, k, v = (w.reshape(config.n_heads, d, -1) for w in block.attn.Wqkv.weight.chunk(3, dim=0))
        return {"W_Q": q[head], "W_K": k[head], "W_V": v[head], "W_O": block.attn.out_proj.weight[:, rows]}
    attn = block.self_attention
    q, k, v = _split(name, attn, attn.query_key_value.weight)
    kv = head if k.shape[0] > 1 else 0  # multi-query: the one key and value head
    parts = {"W_Q": q[head], "W_K": k[kv], "W_V": v[kv]}
    if attn.query_key_value.bias is not None:
        bq, bk, bv = _split(name, attn, attn.query_key_value.bias)
        parts |= {"b_Q": bq[head, :, 0], "b_K": bk[kv, :, 0], "b_V": bv[kv, :, 0]}
    return parts | {"W_O": attn.dense.weight[:, rows]}


@pytest.mark.parametrize("name", NAMES)
def test_each_heads_weights_are_the_rows_transformers_splits_out(built, name):
    folder, model = built(name)
    assert_every_head_dumped(folder, lambda layer, head: _expected_slices(name, model, layer, head), name)


@pytest.mark.parametrize(("name", "change"), [
    ("falcon_mq", lambda c: c | {"alibi": True}),  # Falcon-RW: transformers' bias is not ALiBi's
    ("mpt", lambda c: c | {"attn_config": c["attn_config"] | {"clip_qkv": 0.5}}),  # a clamp before the split
])
def test_what_a_page_does_not_compute_runs_through_transformers(built, runner, tmp_path, name, change):
    from transformers import AutoModelForCausalLM

    folder = with_config(built(name)[0], tmp_path / name, change)
    payload = _json(runner, folder, "--text", SENTENCE, "--all-heads", "--layer", "1")
    assert payload["traced"] is False
    eager = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = eager(torch.tensor([payload["token_ids"]]), output_attentions=True).attentions[1][0]
    for head in payload["heads"]:
        _close(head["attention"], theirs[head["head"]], f"{name} head {head['head']}")
