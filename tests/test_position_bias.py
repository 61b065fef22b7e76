"""A position bias added to the scores (position_bias.py): the steps, against T5's own eager attention and a
float64 formula written here; sdpa and mha on the command line with --position-bias and --check; the estimate
equal to the traced run; bad biases refused in one line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from attnscope import cost
from attnscope.attention.dot_product import sdpa
from attnscope.attention.multihead import MultiHeadAttention
from attnscope.errors import UsageError
from attnscope.runs.mha import MhaOptions, run_mha
from attnscope.runs.sdpa import SdpaOptions, run_sdpa
from attnscope.spec import AttentionSpec


def _float64(q, k, v, bias, causal=False):
    s = torch.einsum("...qd,...kd->...qk", q.double(), k.double()) / math.sqrt(q.shape[-1]) + bias.double()
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    p = torch.softmax(s, dim=-1)
    return p @ v.double(), p


@pytest.mark.parametrize("shape", [(1, 4, 5, 7), (4, 5, 7), (5, 7), (1, 1, 5, 7)])
def test_sdpa_adds_the_bias_as_its_own_step(shape):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, d, generator=g) for n, d in ((5, 8), (7, 8), (7, 3)))
    bias = torch.randn(shape, generator=g)
    trace = sdpa(q, k, v, position_bias=bias, causal="lower-right")
    names = [s.name for s in trace.steps]
    assert names[names.index("scores"):] == ["scores", "position_bias", "biased_scores", "masked_scores", "attention",
                                              "out"]
    assert trace.step("position_bias").dims[-2:] == ("n_Q", "n_K")
    assert len(trace.step("position_bias").dims) == len(shape)
    s = torch.einsum("...qd,...kd->...qk", q.double(), k.double()) / math.sqrt(8) + bias.double()
    s = s.masked_fill(~torch.ones(5, 7, dtype=torch.bool).tril(diagonal=2), -math.inf)
    torch.testing.assert_close(trace["attention"].double(), torch.softmax(s, -1), atol=1e-6, rtol=1e-6)


def test_sdpa_with_a_bias_equals_t5s_eager_attention():
    """T5's `eager_attention_forward`: unscaled scores + position_bias, softmax (transformers' own code)."""
    from transformers.models.t5.modeling_t5 import eager_attention_forward

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 3, 6, 4, generator=g) for _ in range(3))
    bias = torch.randn(1, 3, 6, 6, generator=g)
    out, weights = eager_attention_forward(torch.nn.Module().eval(), q, k, v, None, scaling=1.0, position_bias=bias)
    trace = sdpa(q, k, v, position_bias=bias, scale=1.0)
    torch.testing.assert_close(trace["attention"], weights)
    torch.testing.assert_close(trace["out"], out.transpose(1, 2))


def test_multihead_records_the_bias_and_its_fused_path_agrees():
    torch.manual_seed(0)
    traced = MultiHeadAttention(16, 4, causal=True)
    fused = MultiHeadAttention(16, 4, causal=True, record=False)
    fused.load_state_dict(traced.state_dict())
    x = torch.randn(2, 5, 16)
    bias = torch.randn(1, 4, 5, 5)
    trace = traced(x, position_bias=bias)
    assert trace.step("biased_scores").dims == ("n_batch", "n_head", "n_Q", "n_K")
    torch.testing.assert_close(fused(x, position_bias=bias)["x"], trace["x"])
    q = traced.W_q(x).view(2, 5, 4, 4).transpose(1, 2)
    k = traced.W_k(x).view(2, 5, 4, 4).transpose(1, 2)
    v = traced.W_v(x).view(2, 5, 4, 4).transpose(1, 2)
    _, p = _float64(q, k, v, bias, causal=True)
    torch.testing.assert_close(trace["attention"].double(), p, atol=1e-6, rtol=1e-6)


def test_bad_biases_are_refused_naming_the_parameter():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(UsageError, match="position_bias is \\[1, 2, 3, 5\\] but the scores are \\[1, 2, 3, 3\\]"):
        sdpa(q, q, q, position_bias=torch.zeros(1, 2, 3, 5))
    with pytest.raises(UsageError, match="must hold floats"):
        sdpa(q, q, q, position_bias=torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(UsageError, match="alibi and position_bias are two position biases"):
        sdpa(q, q, q, position_bias=torch.zeros(3, 3), alibi=True)


@pytest.fixture
def bias_files(tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "heads.npy", rng.standard_normal((1, 4, 6, 9)).astype(np.float32))
    np.save(tmp_path / "one.npy", rng.standard_normal((6, 9)).astype(np.float32))
    np.save(tmp_path / "self.npy", rng.standard_normal((1, 4, 6, 6)).astype(np.float32))
    return tmp_path


def test_sdpa_and_mha_check_the_bias_against_the_float64_formula(runner, bias_files):
    from attnscope.cli import app

    one, heads = str(bias_files / "one.npy"), str(bias_files / "heads.npy")
    result = runner.invoke(app, ["sdpa", "--batch", "2", "--nq", "6", "--nk", "9", "--dk", "8", "--dv", "8",
                                 "--position-bias", one, "--causal", "--check", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["params"]["position_bias"] == one
    assert {c["reference"] for c in payload["check"]} == {"float64 formula"}
    assert all(c["passed"] for c in payload["check"])
    result = runner.invoke(app, ["mha", "--batch", "1", "--nq", "6", "--nk", "9", "--d-feat", "16", "--heads", "4",
                                 "--position-bias", heads, "--check", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [t["name"] for t in payload["tensors"]].count("position_bias") == 1
    assert all(c["passed"] for c in payload["check"])


def test_a_changed_bias_fails_the_check(bias_files, monkeypatch):
    """The reference reads the file again, not attnscope's step: a bias attnscope dropped would fail."""
    import attnscope.attention.dot_product as attention

    original = attention.add_position_bias
    monkeypatch.setattr(attention, "add_position_bias",
                        lambda trace, logits, last, bias, leading: original(trace, logits, last, bias * 0, leading))
    result = run_sdpa(SdpaOptions(batch=1, nq=6, nk=9, dk=8, dv=8, position_bias=str(bias_files / "one.npy"),
                                  check=True))
    assert not all(c.passed for c in result.comparisons)


def test_estimate_counts_the_bias_as_the_traced_run_does(bias_files):
    heads = str(bias_files / "self.npy")
    real = run_mha(MhaOptions(batch=1, nq=6, d_feat=16, heads=4, position_bias=heads))
    meta = run_mha(MhaOptions(batch=1, nq=6, d_feat=16, heads=4, position_bias=heads, meta=True))
    analytic = cost.mha_bytes(1, 6, 6, 16, 4, AttentionSpec(), position_bias=4 * 36)
    assert real.peak_bytes == meta.peak_bytes == analytic
    one = str(bias_files / "one.npy")
    real = run_sdpa(SdpaOptions(batch=2, nq=6, nk=9, dk=8, dv=8, position_bias=one, causal="upper-left"))
    assert real.peak_bytes == cost.sdpa_bytes(2, 6, 9, 8, 8, AttentionSpec(causal=True), bias=54)


def test_cli_refuses_a_bias_that_does_not_fit(runner, bias_files):
    from attnscope.cli import app

    result = runner.invoke(app, ["mha", "--batch", "1", "--nq", "6", "--d-feat", "16", "--heads", "4",
                                 "--position-bias", str(bias_files / "heads.npy")])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "attnscope: error: --position-bias is [1, 4, 6, 9] but the scores are [1, 4, 6, 6]: the bias must "
        "broadcast to them ([.., n_Q, n_K], 1 for any axis it shares)"]
    result = runner.invoke(app, ["sdpa", "--layout", "col", "--position-bias", str(bias_files / "one.npy")])
    assert result.exit_code == 2 and "--position-bias work in the row layout" in result.stderr


@st.composite
def biased_case(draw):
    """Q, K, V of any batch and head layout, a bias of any rank that broadcasts to the scores, any alignment."""
    batch = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    n_Q, n_K, d_K, d_V = (draw(st.integers(1, 6)) for _ in range(4))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    Q, K, V = (torch.randn(*batch, n, d, generator=g) for n, d in ((n_Q, d_K), (n_K, d_K), (n_K, d_V)))
    scores = (*batch, n_Q, n_K)
    keep = draw(st.lists(st.booleans(), min_size=len(scores), max_size=len(scores)))
    rank = draw(st.integers(2, len(scores)))
    shape = [size if kept or axis >= len(scores) - 2 else 1
             for axis, (size, kept) in enumerate(zip(scores, keep, strict=True))]
    bias = torch.randn(shape[len(scores) - rank:], generator=g) * draw(st.floats(0.0, 4.0))
    causal = draw(st.sampled_from([None, "upper-left", "lower-right"]))
    return Q, K, V, bias, causal


@fuzz_settings(60)
@given(biased_case())
def test_any_broadcast_bias_equals_the_float64_formula(case):
    """Any bias that broadcasts to the scores, with any causal alignment, against the formula in float64 written
    here (with PyTorch's rule that a query seeing no key gets zeros)."""
    Q, K, V, bias, causal = case
    n_Q, n_K = Q.shape[-2], K.shape[-2]
    trace = sdpa(Q, K, V, position_bias=bias, causal=causal)
    s = torch.einsum("...qd,...kd->...qk", Q.double(), K.double()) / math.sqrt(Q.shape[-1]) + bias.double()
    if causal:
        offset = n_K - n_Q if causal == "lower-right" else 0
        s = s.masked_fill(~torch.ones(n_Q, n_K, dtype=torch.bool).tril(diagonal=offset), -math.inf)
    p = torch.softmax(s, dim=-1)
    p = torch.where(torch.isneginf(s).all(dim=-1, keepdim=True), 0.0, p)
    torch.testing.assert_close(trace["attention"].double(), p, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(trace["out"].double(), p @ V.double(), atol=1e-5, rtol=1e-5)
    assert trace.step("position_bias").dims[-2:] == ("n_Q", "n_K")
