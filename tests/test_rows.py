"""Unrecorded attention in eager's order, by blocks of query rows (attention/rows.py): every block split gives
PyTorch's float64 attention with the mask written out here from positions, for causal alignments, windows (one
side and both), chunks, ALiBi, softcapping, sinks, GQA, user masks and a position bias; and a model's layers below
the one shown agree with a module computed in one block."""

from __future__ import annotations

import math

import pytest
import torch
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from attnscope.attention.multihead import MultiHeadAttention
from attnscope.attention.rows import eager_rows
from attnscope.masks import structural, structural_rows
from attnscope.spec import AttentionSpec

SPECS = [
    AttentionSpec(),
    AttentionSpec(causal=True),
    AttentionSpec(causal="lower-right"),
    AttentionSpec(causal=True, window=3),
    AttentionSpec(causal="lower-right", window=2),
    AttentionSpec(causal=True, chunk=4),
    AttentionSpec(window=4, window_side="both"),
    AttentionSpec(start=5),
]


def _allowed(spec: AttentionSpec, n_Q: int, n_K: int) -> torch.Tensor:
    """The structural mask from positions, written out element by element."""
    offset = (n_K - n_Q if spec.align == "lower-right" else 0) if spec.align else spec.start
    out = torch.ones(n_Q, n_K, dtype=torch.bool)
    for i in range(n_Q):
        p = i + offset
        for j in range(n_K):
            if spec.window is not None and spec.window_side == "both":
                out[i, j] = abs(p - j) <= spec.window // 2
            elif spec.align is not None:
                ok = j <= p
                if spec.window is not None:
                    ok = ok and p - j < spec.window
                if spec.chunk is not None:
                    ok = ok and j // spec.chunk == p // spec.chunk
                out[i, j] = ok
    return out


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize(("n_Q", "n_K"), [(7, 7), (3, 9), (1, 6)])
def test_structural_rows_are_the_rows_of_the_whole_mask(spec, n_Q, n_K):
    whole = _allowed(spec, n_Q, n_K)
    built, _ = structural(spec, n_Q, n_K)
    if built is None:
        assert structural_rows(spec, n_Q, n_K, 0, n_Q) is None and bool(whole.all())
        return
    assert torch.equal(built, whole)
    for first in range(n_Q):
        for last in range(first + 1, n_Q + 1):
            assert torch.equal(structural_rows(spec, n_Q, n_K, first, last), whole[first:last])


def _reference(Q, K, V, spec, mask, n_group, alibi_slopes, softcap, sinks, bias):
    """float64: scores, softcap, ALiBi, bias, mask, softmax (with a sink column), zero rows, @ V."""
    Q, K, V = Q.double(), K.double(), V.double()
    K, V = K.repeat_interleave(n_group, dim=1), V.repeat_interleave(n_group, dim=1)
    n_Q, n_K = Q.shape[-2], K.shape[-2]
    scores = Q @ K.transpose(-1, -2) * (spec.scale if spec.scale is not None else 1 / math.sqrt(Q.shape[-1]))
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    offset = (n_K - n_Q if spec.align == "lower-right" else 0) if spec.align else spec.start
    if alibi_slopes is not None:
        distance = torch.arange(n_K)[None, :] - (torch.arange(n_Q)[:, None] + offset)
        scores = scores + torch.tensor(alibi_slopes, dtype=torch.float64)[:, None, None] * distance
    if bias is not None:
        scores = scores + bias.double()
    allowed = _allowed(spec, n_Q, n_K)
    if mask is not None:
        allowed = allowed & mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    weights = torch.nan_to_num(weights, nan=0.0).masked_fill(~allowed.any(-1, keepdim=True), 0.0)
    return weights @ V


@fuzz_settings(40)
@given(spec=st.sampled_from(SPECS), n_Q=st.integers(1, 12), extra=st.integers(0, 5), n_kv=st.sampled_from([1, 2, 4]),
       block=st.integers(1, 200), use_mask=st.booleans(), softcap=st.sampled_from([None, 2.0]),
       alibi=st.booleans(), sinks=st.booleans(), bias=st.booleans(), seed=st.integers(0, 99))
def test_every_block_split_gives_float64_attention(spec, n_Q, extra, n_kv, block, use_mask, softcap, alibi, sinks,
                                                   bias, seed):
    from dataclasses import replace

    n_head, n_K = 4, n_Q + extra
    g = torch.Generator().manual_seed(seed)
    Q = torch.randn(2, n_head, n_Q, 8, generator=g)
    K, V = torch.randn(2, n_kv, n_K, 8, generator=g), torch.randn(2, n_kv, n_K, 8, generator=g)
    slopes = tuple(float(2 ** -(h + 1)) for h in range(n_head)) if alibi else None
    spec = replace(spec, softcap=softcap, alibi=alibi, alibi_slopes=slopes, sinks=sinks)
    mask = torch.rand(2, 1, 1, n_K, generator=g) > 0.2 if use_mask else None
    sink_values = torch.randn(n_head, generator=g) if sinks else None
    position_bias = torch.randn(1, n_head, n_Q, n_K, generator=g) if bias and not alibi else None  # one or the other
    got = eager_rows(Q, K, V, mask, spec, n_group=n_head // n_kv, sinks=sink_values, position_bias=position_bias,
                     block_bytes=block * 4)
    want = _reference(Q, K, V, spec, mask, n_head // n_kv, slopes, softcap, sink_values, position_bias)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_unrecorded_module_matches_the_recorded_one_and_fused_is_kept():
    """record=False runs eager's order (bit-equal to the recorded x); fused=True keeps PyTorch's kernel for
    `attnscope bench`, equal to float precision."""
    torch.manual_seed(0)
    recorded = MultiHeadAttention(32, 4, causal=True, n_kv_head=2, window=5).eval()
    plain = MultiHeadAttention(32, 4, causal=True, n_kv_head=2, window=5, record=False).eval()
    fused = MultiHeadAttention(32, 4, causal=True, n_kv_head=2, window=5, record=False, fused=True).eval()
    plain.load_state_dict(recorded.state_dict())
    fused.load_state_dict(recorded.state_dict())
    X = torch.randn(2, 11, 32)
    with torch.no_grad():
        want = recorded(X)["x"]
        assert torch.equal(plain(X)["x"], want)
        torch.testing.assert_close(fused(X)["x"], want, atol=1e-6, rtol=1e-5)
