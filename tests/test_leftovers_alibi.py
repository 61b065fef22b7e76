"""ALiBi's slopes are worked out once per attention and handed to the bias and to its words; the result is
transformers' BLOOM `build_alibi_tensor` and MPT's `build_mpt_alibi_tensor` (each a row constant away from the
paper's `-m_h · (i - j)`, so the softmax agrees), and a slope per head is checked against the head count."""

from __future__ import annotations

import pytest
import torch

from attnscope import MultiHeadAttention, sdpa
from attnscope.errors import UsageError
from attnscope.spec import AttentionSpec
from attnscope.variants import alibi


def _counting_slopes(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = alibi.slopes
    monkeypatch.setattr(alibi, "slopes", lambda n_head: calls.append(n_head) or real(n_head))
    return calls


def _qkv(n_head: int, n_Q: int, n_K: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, n_head, n, 8, generator=generator) for n in (n_Q, n_K, n_K))


def _reference_attention(Q, K, V, key_bias: torch.Tensor, causal: bool) -> torch.Tensor:
    """float64 softmax(Q Kᵀ / sqrt(d) + key_bias) with the lower-right causal mask: key_bias `[n_head, 1, n_K]`
    as BLOOM and MPT add it, one value per key."""
    Q, K = Q.double(), K.double()
    scores = Q @ K.transpose(-1, -2) / Q.shape[-1] ** 0.5 + key_bias.double()  # [n_batch, n_head, n_Q, n_K]
    if causal:
        n_Q, n_K = scores.shape[-2:]
        allowed = torch.ones(n_Q, n_K, dtype=torch.bool).tril(n_K - n_Q)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1)


@pytest.mark.parametrize("n_head", [1, 4, 6, 8, 12])
def test_sdpa_works_the_slopes_out_once_and_agrees_with_bloom(monkeypatch, n_head):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    Q, K, V = _qkv(n_head, 5, 7)
    calls = _counting_slopes(monkeypatch)
    trace = sdpa(Q, K, V, alibi=True, causal="lower-right")
    assert calls == [n_head]  # once, for the bias and its words alike
    bloom = build_alibi_tensor(torch.ones(1, 7), n_head, torch.float64)[:, 0, :]  # [n_head, n_K]: m_h · j
    m = bloom[:, 1]  # [n_head]
    offset = 7 - 5  # lower-right: query i sits at position i + 2
    position = (torch.arange(5, dtype=torch.float64) + offset)[None, :, None]  # [1, n_Q, 1]
    # the paper's -m_h (i + offset - j) is BLOOM's m_h j less one constant per row, m_h (i + offset)
    torch.testing.assert_close(trace["alibi_bias"].double() + m[:, None, None] * position,
                               bloom[:, None, :].expand(n_head, 5, 7), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(trace["attention"].double(), _reference_attention(Q, K, V, bloom[:, None], True),
                               rtol=1e-5, atol=1e-6)
    shown = ", ".join(f"{s:.4g}" for s in m[:4].tolist())
    assert shown in trace.step("alibi_bias").op


@pytest.mark.parametrize("n_head", [2, 6, 8, 12])
def test_multihead_attention_agrees_with_mpt_and_works_the_slopes_out_once(monkeypatch, n_head):
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    torch.manual_seed(n_head)
    module = MultiHeadAttention(8 * n_head, n_head, causal=True, alibi=True)
    X = torch.randn(2, 6, 8 * n_head)
    calls = _counting_slopes(monkeypatch)
    trace = module(X)
    assert calls == [n_head]
    mpt = build_mpt_alibi_tensor(n_head, 6).double()  # [n_head, 1, n_K]: m_h (j - n_K + 1)
    Q, K = trace["Q_split"], trace["K_split"]
    torch.testing.assert_close(trace["attention"].double(), _reference_attention(Q, K, None, mpt, True),
                               rtol=1e-5, atol=1e-6)


def test_given_slopes_are_used_as_given_and_one_per_head(monkeypatch):
    Q, K, V = _qkv(3, 4, 4)
    calls = _counting_slopes(monkeypatch)
    given = (0.5, 0.125, 0.03125)
    trace = sdpa(Q, K, V, spec=AttentionSpec(causal=True, alibi=True, alibi_slopes=given))
    assert calls == []
    distance = (torch.arange(4.0)[:, None] - torch.arange(4.0)[None, :])  # [n_Q, n_K]
    torch.testing.assert_close(trace["alibi_bias"], -torch.tensor(given)[:, None, None] * distance)
    with pytest.raises(UsageError, match=r"^alibi_slopes gives 2 slopes for 3 heads; give one per head$"):
        sdpa(Q, K, V, spec=AttentionSpec(causal=True, alibi=True, alibi_slopes=(0.5, 0.25)))
