"""attention/linear_attention.py's M @ V check taken in blocks of rows over the columns each block may weigh,
against the whole product in float64 (`(M @ V - x_raw).abs().max()`), with and without earlier positions
(a decode step's cache) and a last block shorter than the rest."""

from __future__ import annotations

import pytest
import torch

from attnscope.attention.linear_attention import _check, effective_matrix, recurrence


@pytest.mark.parametrize(("n_cache", "n", "rows"), [(0, 70, 16), (9, 33, 8), (5, 1, 256)])
def test_blocked_check_equals_the_whole_product(n_cache, n, rows):
    torch.manual_seed(n)
    n_head, d_K, d_V = 2, 8, 6
    total = n_cache + n
    q = torch.randn(1, n_head, total, d_K)
    k = torch.nn.functional.normalize(torch.randn(1, n_head, total, d_K), dim=-1)
    v = torch.randn(1, n_head, total, d_V)
    g, beta = -torch.rand(1, n_head, total) * 0.2, torch.rand(1, n_head, total)
    _, S = recurrence(q[..., :n_cache, :], k[..., :n_cache, :], v[..., :n_cache, :], g[..., :n_cache],
                      beta[..., :n_cache], torch.zeros(1, n_head, d_K, d_V))
    _, A = effective_matrix(q[..., :n_cache, :], k[..., :n_cache, :], g[..., :n_cache], beta[..., :n_cache],
                            torch.zeros(1, n_head, d_K, 0, dtype=torch.float64))
    x_raw, _ = recurrence(q[..., n_cache:, :], k[..., n_cache:, :], v[..., n_cache:, :], g[..., n_cache:],
                          beta[..., n_cache:], S)
    M, _ = effective_matrix(q[..., n_cache:, :], k[..., n_cache:, :], g[..., n_cache:], beta[..., n_cache:], A)
    whole = float((M @ v.double() - x_raw.double()).abs().max())
    assert whole < 1e-4  # M is the layer's exact matrix
    assert _check(M, v, x_raw, rows) == pytest.approx(whole, rel=1e-9, abs=1e-15)
