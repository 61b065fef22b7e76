"""The every-layer digest's faster parts (readings/headstats.py's InductionPairs and entropy, layerdigest.py's
thumbnail groups, rollout.LastRows' packing), held to formulas of the test's own: plain loops over the weights and
PyTorch's xlogy."""

from __future__ import annotations

import random

import torch

from attnscope.readings import headstats
from attnscope.readings.headstats import InductionPairs, row_sums
from attnscope.readings.layerdigest import EveryLayer
from attnscope.readings.rollout import LastRows


def _induction_loop(A: torch.Tensor, first: int, tokens: list[int]) -> torch.Tensor:
    """Each row's weight on the keys k < p whose previous token is p's, NaN where there is none."""
    G, n_rows, n_K = A.shape
    out = torch.full((G, n_rows), float("nan"), dtype=torch.float64)
    for i in range(n_rows):
        p = first + i
        keys = [k for k in range(1, min(p, n_K)) if p < len(tokens) and tokens[k - 1] == tokens[p]]
        if keys:
            out[:, i] = A[:, i, keys].sum(dim=-1)
    return out


def test_induction_pairs_are_the_loop():
    draw = random.Random(0)
    torch.manual_seed(0)
    for _ in range(40):
        n = draw.randint(1, 50)
        tokens = [draw.randrange(draw.randint(1, 6)) for _ in range(n)]
        pairs = InductionPairs.of(tokens)
        assert pairs is not None
        A = torch.rand(3, n, n, dtype=torch.float64).tril()
        first = draw.randrange(n)
        last = draw.randint(first + 1, n)
        for keys in (n, last):
            block = A[:, first:last, :keys].contiguous()
            torch.testing.assert_close(pairs.rows(block, first), _induction_loop(block, first, tokens),
                                       rtol=1e-14, atol=0, equal_nan=True)


def test_induction_pairs_refuse_a_text_of_one_token():
    assert InductionPairs.of([7] * 1000) is None  # n²/2 pairs: the dense mask instead


def test_entropy_is_xlogy():
    A = torch.rand(4, 9, 30, dtype=torch.float64)
    A[A < 0.3] = 0.0
    A[0, 0, 0] = float("nan")
    A = A / A.nansum(dim=-1, keepdim=True).clamp_min(1e-300)
    torch.testing.assert_close(headstats._entropy(A), -torch.special.xlogy(A, A).sum(dim=-1), equal_nan=True,
                               rtol=1e-15, atol=1e-15)


def test_row_sums_with_pairs_and_mass_are_the_plain_call():
    torch.manual_seed(1)
    tokens = [random.Random(2).randrange(4) for _ in range(40)]
    A = torch.softmax(torch.randn(5, 40, 40, dtype=torch.float64).masked_fill(
        ~torch.ones(40, 40, dtype=torch.bool).tril(), float("-inf")), dim=-1)
    block = A[:, 10:25, :25]
    causal = torch.ones(5, dtype=torch.bool)
    plain = row_sums(block, 10, causal, tokens)
    fast = row_sums(block, 10, causal, pairs=InductionPairs.of(tokens), mass=block.sum(dim=-1))
    for name in plain[0]:
        torch.testing.assert_close(fast[0][name], plain[0][name], rtol=1e-14, atol=1e-15)
        assert torch.equal(fast[1][name], plain[1][name])


def test_thumbnail_groups_are_pooling_sums():
    torch.manual_seed(3)
    n = 37
    A = torch.softmax(torch.randn(2, n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")), -1)
    labels = [str(i) for i in range(n)]
    digest = EveryLayer(labels, labels, None, (4, 5), 1)
    block = A[:, 8:20].to(torch.float64)[..., :20]
    got = digest._keyed(A[:, 8:20], block, block.sum(dim=-1), n)
    want = torch.stack([A[:, 8:20, k: k + 5].double().sum(dim=-1) for k in range(0, n, 5)], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-15, atol=1e-15)
    A[1, 10, 3] = float("nan")  # a NaN stays in its own cell
    block = A[:, 8:20].to(torch.float64)[..., :20]
    got = digest._keyed(A[:, 8:20], block, block.sum(dim=-1), n)
    assert got[1, 2, 0].isnan() and not got[1, 2, 1:].isnan().any()


def test_packed_rows_are_the_lower_triangle():
    n = 11
    chains = LastRows(n, 2, ("rollout",))
    M = torch.rand(n, n, dtype=torch.float64).tril()
    chains.start(True)
    for first in range(0, n, 4):
        chains.put("rollout", first, M[first: first + 4, : min(n, first + 4)])
    torch.testing.assert_close(chains.matrix("rollout", 0), M.float().double())
