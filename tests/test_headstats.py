"""What a head does: statistics against hand-computed values, kinds from the documented thresholds, and the
notebook view of a trace."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest
import torch
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from attnscope import MultiHeadAttention, sdpa
from attnscope.readings.headstats import describe_heads, head_stats, kind
from attnscope.views.colors import VIRIDIS, viridis


def _previous_token(n: int) -> torch.Tensor:
    A = torch.zeros(n, n)
    A[0, 0] = 1.0
    for i in range(1, n):
        A[i, i - 1] = 1.0
    return A


def test_pure_previous_token_pattern():
    stats = head_stats(_previous_token(8))
    assert stats.previous == 1.0 and stats.entropy == 0.0
    assert stats.first == pytest.approx(2 / 8) and stats.self == pytest.approx(1 / 8)
    assert stats.distance == pytest.approx(7 / 8)
    assert kind(stats) == "previous-token"


def test_uniform_pattern_is_broad_with_entropy_log2_n():
    n = 16
    stats = head_stats(torch.full((n, n), 1 / n))
    assert stats.entropy == pytest.approx(math.log2(n)) and stats.spread == pytest.approx(1.0)
    assert kind(stats) == "broad"


def test_causal_uniform_is_broad_too():
    n = 10
    A = torch.tril(torch.ones(n, n))
    A = A / A.sum(dim=-1, keepdim=True)
    stats = head_stats(A)
    assert stats.entropy == pytest.approx(sum(math.log2(i + 1) for i in range(n)) / n)
    assert kind(stats) == "broad"


def test_first_token_self_local_and_mixed():
    n = 12
    sink = torch.zeros(n, n)
    sink[:, 0] = 1.0
    assert kind(head_stats(sink)) == "first-token"
    assert kind(head_stats(torch.eye(n))) == "self"
    local = torch.zeros(n, n)  # a third on each of i-1, i, i+1 (clipped at the edges, renormalized)
    for i in range(n):
        for j in (i - 1, i, i + 1):
            if 0 <= j < n:
                local[i, j] = 1.0
    local = local / local.sum(dim=-1, keepdim=True)
    assert kind(head_stats(local)) == "local"
    far = torch.zeros(n, n)  # half on the token 6 back, half spread thinly
    for i in range(n):
        far[i, (i + 6) % n] = 0.45
        far[i, (i + 5) % n] = 0.35
        far[i, (i + 3) % n] = 0.2
    assert kind(head_stats(far)) == "mixed"


def test_offset_rows_and_fully_masked_rows():
    A = torch.zeros(3, 5)
    A[0] = 0.0  # a query that may see no key: left out
    A[1, 3] = 1.0  # query 1 at position 3 (offset 2): self
    A[2, 4] = 1.0
    stats = head_stats(A, offset=2)
    assert stats.self == 1.0 and stats.first == 0.0 and stats.previous == 0.0


def test_describe_heads_of_a_real_run():
    trace = MultiHeadAttention(16, 4, causal=True)(torch.randn(1, 6, 16))
    heads = describe_heads(trace["attention"][0])
    assert [h["head"] for h in heads] == [0, 1, 2, 3]
    assert all(set(h["stats"]) == {"entropy", "first", "previous", "self", "distance", "spread"} for h in heads)


def _by_the_definitions(A: torch.Tensor, offset: int, tokens: list[int] | None) -> dict[str, float]:
    """The statistics of one `[n_Q, n_K]` pattern, row by row in plain Python floats, as the module docstring
    defines them (shares no code with headstats)."""
    n_Q, n_K = A.shape
    rows = A.double().tolist()
    causal = all(rows[i][j] == 0 for i in range(n_Q) for j in range(n_K) if j > i + offset)
    sums = dict.fromkeys(("entropy", "first", "previous", "self", "distance", "spread", "induction"), 0.0)
    counts = dict.fromkeys(sums, 0)

    def take(name: str, value: float) -> None:
        sums[name] += value
        counts[name] += 1

    for i, row in enumerate(rows):
        p = i + offset
        if sum(row) <= 0:
            continue
        entropy = -sum(a * math.log2(a) for a in row if a > 0)
        take("entropy", entropy)
        take("first", row[0])
        if 1 <= p <= n_K:
            take("previous", row[p - 1])
        if p < n_K:
            take("self", row[p])
        take("distance", sum(a * abs(p - j) for j, a in enumerate(row)))
        visible = min(p + 1, n_K) if causal else n_K
        if visible >= 2:
            take("spread", entropy / math.log2(visible))
        if tokens is not None and p < len(tokens):
            targets = [j + 1 for j in range(n_K - 1) if j + 1 < p and tokens[j] == tokens[p]]
            if targets:
                take("induction", sum(row[t] for t in targets))
    means = {name: sums[name] / counts[name] if counts[name] else 0.0 for name in sums}
    if tokens is None:
        del means["induction"]
    return means


@fuzz_settings(40)
@given(st.integers(1, 5), st.integers(1, 9), st.integers(1, 9), st.integers(0, 4), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_every_head_at_once_equals_the_definitions_head_by_head(n_head, n_Q, n_K, offset, with_tokens, seed):
    """describe_heads takes a layer's heads together (a batch of causal and bidirectional patterns, some rows
    that see nothing); each head's numbers equal the definitions applied to it alone."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(n_head, n_Q, n_K, generator=generator, dtype=torch.float64)
    future = torch.arange(n_K)[None, :] > torch.arange(n_Q)[:, None] + offset
    causal_heads = torch.rand(n_head, generator=generator) < 0.5
    scores = scores.masked_fill(causal_heads[:, None, None] & future, float("-inf"))
    A = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    A[:, torch.rand(n_Q, generator=generator) < 0.2] = 0.0  # queries that may see no key
    tokens = torch.randint(0, 3, (n_K + offset + n_Q,), generator=generator).tolist() if with_tokens else None
    for h, head in enumerate(describe_heads(A.float(), offset, tokens)):
        expected = _by_the_definitions(A.float()[h], offset, tokens)
        assert head["head"] == h and head["stats"].keys() == expected.keys()
        for name, value in expected.items():
            assert head["stats"][name] == pytest.approx(value, abs=1e-9), (h, name)


def test_viridis_ends_and_middle():
    assert viridis(0.0) == VIRIDIS[0] and viridis(1.0) == VIRIDIS[-1] and viridis(float("nan")) == VIRIDIS[0]
    assert viridis(0.5) == VIRIDIS[5]


def test_trace_shows_itself_in_a_notebook():
    trace = sdpa(torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 2), causal=True)
    page = trace._repr_html_()
    for step in trace.steps:
        assert f"<b>{step.name}</b>" in page
    svg = page[page.index("<svg"): page.index("</svg>") + 6]
    ET.fromstring(svg)  # well-formed
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    static, script = page.split("<script>")  # the static view, then the script that opens the explorer page
    assert "<script" not in static and "srcdoc" in script
    assert "Trace(" in repr(trace)
