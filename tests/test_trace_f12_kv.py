"""`attnscope trace` where a module's own bias says which block of a fused projection is the keys' (a constant-zero
block beside learned ones: BEiT's `cat(q_bias, zeros_like(v_bias), v_bias)`, EVA's zero buffer, a `new_zeros`
chunk, a fused K/V's `cat(zeros, v_bias)`): unpacking the fused output with k and v named the other way round is
kv.swapped by experiment, while the same rename over blocks that are alike stays a layout of the weights (a note).
Styles: tests/trace_styles_f12_kv.py, each checked against F.scaled_dot_product_attention in float64, each plant
shown to change the output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_f12_kv.py")
styles = user_module(STYLES)
KV_STYLES = ["CatZerosBias", "ZeroBufferBias", "ChunkedParamBias", "KVZeroBias"]


def _heads(t, h):
    b, n, d = t.shape
    return t.view(b, n, h, d // h).transpose(1, 2)


def _sdpa(q, k, v, h):
    y = F.scaled_dot_product_attention(_heads(q, h), _heads(k, h), _heads(v, h))
    return y.transpose(1, 2).reshape(q.shape)


def _want(m, x):
    """The module's attention in float64 from its weights: q, k, v by the bias's blocks (the keys' a zero), SDPA."""
    d = x.shape[-1]
    if isinstance(m, styles.KVZeroBias):
        k, v = F.linear(x, m.to_kv.weight).split(d, -1)
        return m.to_out(_sdpa(m.to_q(x), k, v + m.v_bias, 4))
    if isinstance(m, styles.ChunkedParamBias):
        q, k, v = (x @ m.w_qkv).split(d, -1)
        b_q, _, b_v = m.b_qkv.chunk(3)
        return m.w_out(_sdpa(q + b_q, k, v + b_v, 4))
    q, k, v = F.linear(x, m.qkv.weight).split(d, -1)
    k_bias = m.k_bias if getattr(m, "k_bias", None) is not None else 0
    return (m.proj if hasattr(m, "proj") else m.out)(_sdpa(q + m.q_bias, k + k_bias, v + m.v_bias, 4))


@pytest.mark.parametrize("name", KV_STYLES)
def test_the_styles_are_sdpa_and_the_renames_change_them(name):
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    m = getattr(styles, name)().double()
    with torch.no_grad():
        want = _want(m, x)
        assert torch.allclose(m(x), want, atol=1e-10)
        wrong = getattr(styles, name)(bug="kv_renamed").double()
        wrong.load_state_dict(m.state_dict())
        assert (wrong(x) - want).abs().max() > 1e-2


@pytest.mark.parametrize("name", KV_STYLES)
def test_correct_forms_pass_and_the_rename_is_a_swap_by_experiment(runner, name):
    result, out = trace(runner, f"{STYLES}:{name}")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert not any("a layout of your weights" in n for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:{name}", "--init", "bug='kv_renamed'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "kv.swapped", out["first_divergence"]
    assert out["first_divergence"]["evidence"].startswith("by experiment")


def test_the_bias_is_what_says_it(runner):
    """The reference says it holds k and v as the bias gives them; with a learned bias on all three blocks the same
    rename is a layout of the weights (a note, exit 0): nothing in the module tells the blocks apart."""
    result, out = trace(runner, f"{STYLES}:CatZerosBias", "--init", "bug='kv_renamed'")
    assert "k and v as your bias gives them (line" in out["reference"], out["reference"]
    assert "torch.zeros_like(v_bias, requires_grad=False), the keys' bias a constant zero" in out["reference"]
    result, out = trace(runner, f"{STYLES}:CatZerosBias", "--init", "bug='kv_renamed', key_bias=True")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any("qkv's rows hold q, v, k, as your code reads them" in n for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:KVZeroBias", "--init", "bug='kv_renamed'")
    assert "k and v as your bias gives them" in out["reference"], out["reference"]
