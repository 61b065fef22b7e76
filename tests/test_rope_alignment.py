"""RoPE at every causal alignment and every shape, queries before key 0 included.

Lower-right with more queries than keys (PyTorch's `causal_lower_right`) puts query i at position
i − (n_Q − n_K): the first queries sit at negative positions and see no key. Their rotation turns back
(cos(−pθ), −sin(pθ)), so a score still depends on i − j alone. Until this was fixed, sdpa and mha rotated the
queries with a table that started at position 0 and crashed ("size of tensor a (4) must match ... (2)").

The references share no code with attnscope: transformers' `LlamaRotaryEmbedding` given the positions as
`position_ids` (negative ones included; its `dynamic_rope_update` takes max(position_ids) + 1 as the length, as
attnscope does) and `apply_rotary_pos_emb`; then a float64 formula for the attention (mask, softmax, a row with
no key gives 0); and check_rope.rotate64, the float64 rotation behind `--check`, held to the same positions.
"""

from __future__ import annotations

import math

import pytest
import torch
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from attnscope import MultiHeadAttention, Rope, sdpa
from attnscope.check.rope import rotate64

TYPES = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2, "rope_theta": 10000.0},
    {"rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 8.0],
     "original_max_position_embeddings": 3, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 2, "rope_theta": 500000.0},
]
D_HEAD, MAX_POS = 4, 4  # small enough that dynamic and longrope switch within the drawn lengths


def _config(parameters):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=2 * D_HEAD, num_attention_heads=2, head_dim=D_HEAD,
                       max_position_embeddings=MAX_POS, rope_parameters=dict(parameters))


def _rotated(Q, K, config, q_start):
    """transformers' rotation of Q `[.., n_Q, d]` at positions q_start .. q_start + n_Q − 1 and K at 0 .. n_K − 1,
    cos and sin computed once over every position, as one forward does (the length matters to dynamic RoPE)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    first, last = min(0, q_start), max(K.shape[-2], q_start + Q.shape[-2])
    if last == first:
        return Q.clone(), K.clone()
    cos, sin = LlamaRotaryEmbedding(config)(Q.float(), torch.arange(first, last)[None])
    q_rows, k_rows = slice(q_start - first, q_start - first + Q.shape[-2]), slice(-first, -first + K.shape[-2])
    return (apply_rotary_pos_emb(Q, Q, cos[:, q_rows], sin[:, q_rows])[0],
            apply_rotary_pos_emb(K, K, cos[:, k_rows], sin[:, k_rows])[0])


def _truth(q, k, v, causal):
    """softmax(q kᵀ / √d, causal) v in float64; a row with no key gives 0."""
    n_Q, n_K = q.shape[-2], k.shape[-2]
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal is not None:
        offset = n_K - n_Q if causal == "lower-right" else 0
        scores = scores.masked_fill(~torch.ones(n_Q, n_K, dtype=torch.bool).tril(offset), float("-inf"))
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return weights @ v.double()


@st.composite
def case(draw):
    return (draw(st.sampled_from(TYPES)), draw(st.integers(0, 7)), draw(st.integers(0, 7)),
            draw(st.sampled_from([None, "upper-left", "lower-right"])), draw(st.integers(0, 2**31 - 1)))


@fuzz_settings(60)
@given(case())
def test_sdpa_rotates_at_the_aligned_positions(drawn):
    parameters, n_Q, n_K, causal, seed = drawn
    config = _config(parameters)
    generator = torch.Generator().manual_seed(seed)
    Q, K, V = (torch.randn(1, 2, n, D_HEAD, generator=generator) for n in (n_Q, n_K, n_K))
    trace = sdpa(Q, K, V, rope=Rope.from_config(config.to_dict()), causal=causal)
    start = n_K - n_Q if causal == "lower-right" else 0
    q_ref, k_ref = _rotated(Q, K, config, start)
    torch.testing.assert_close(trace["Q_rot"], q_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(trace["K_rot"], k_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(trace["out"].double(), _truth(q_ref, k_ref, V, causal), rtol=1e-5, atol=1e-6)
    seq_len = max(n_K, start + n_Q)  # the positions the forward covers, as transformers' max(position_ids) + 1
    for x, ref, at in ((Q, q_ref, start), (K, k_ref, 0)):
        if x.shape[-2]:
            torch.testing.assert_close(rotate64(x, config.to_dict(), start=at, seq_len=seq_len).float(), ref,
                                       rtol=1e-5, atol=1e-6)


@fuzz_settings(30)
@given(case(), st.sampled_from([1, 2]))
def test_mha_rotates_at_the_aligned_positions(drawn, n_kv_head):
    from transformers.models.llama.modeling_llama import repeat_kv

    parameters, n_Q, n_K, causal, seed = drawn
    config = _config(parameters)
    torch.manual_seed(seed)
    layer = MultiHeadAttention(2 * D_HEAD, 2, n_kv_head=n_kv_head, rope=Rope.from_config(config.to_dict()),
                               causal=causal or False)
    x_q, x_k = torch.randn(1, n_Q, 2 * D_HEAD), torch.randn(1, n_K, 2 * D_HEAD)
    trace = layer(x_q, x_k, x_k)

    def heads(W, x):  # [1, n, heads·d_head] -> [1, heads, n, d_head]
        return W(x).view(1, x.shape[1], W.out_features // D_HEAD, D_HEAD).transpose(1, 2)

    start = n_K - n_Q if causal == "lower-right" else 0
    q_ref, k_ref = _rotated(heads(layer.W_q, x_q), heads(layer.W_k, x_k), config, start)
    torch.testing.assert_close(trace["Q_rot"], q_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(trace["K_rot"], k_ref, rtol=1e-5, atol=1e-6)
    group = 2 // n_kv_head
    out = _truth(q_ref, repeat_kv(k_ref, group), repeat_kv(heads(layer.W_v, x_k), group), causal)
    x = layer.W_o(out.float().transpose(1, 2).reshape(1, n_Q, 2 * D_HEAD))
    torch.testing.assert_close(trace["x"], x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("command", ["mha --d-feat 8 --heads 2", "sdpa --dk 8 --dv 8",
                                     "mha --d-feat 8 --heads 2 --kv-lora-rank 3 --rope-head-dim 2"])
@pytest.mark.parametrize(("n_Q", "n_K"), [(4, 2), (5, 1), (3, 3), (2, 5)])
def test_cli_lower_right_rope_check_passes(command, n_Q, n_K):
    """The reported crash, `mha --nq 4 --nk 2 --causal lower-right --rope`, and its neighbours, checked
    against the float64 formula (reference.py, check_rope.rotate64) and PyTorch."""
    from cli_main import run_main

    result = run_main(*command.split(), "--nq", str(n_Q), "--nk", str(n_K), "--causal", "lower-right", "--rope",
                      "--batch", "1", "--check")
    assert result.code == 0, result.stderr
    assert "PASS" in result.stdout and "FAIL" not in result.stdout
