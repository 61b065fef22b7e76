"""`attnscope trace` on round 12's RoPE and softmax conventions (tests/trace_styles_r12_rope.py): RoPE turned by −θ
(nanochat's) is read from the code's rotated tensors as its pairing is, a note and exit 0, and the plants in such
code are named by experiment; a code that turns q and k opposite ways is no convention. Each style is checked here
against a float64 formula of its own (each pair turned coordinate by coordinate) or SDPA, each bug shown to change
the output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_r12_rope.py")
styles = user_module(STYLES)


def _moved(module):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return module.double()


def _turned64(x, positions, pairs, sign):
    """x [b, h, n, d] in float64, pair i (the coordinates `pairs(i)`) turned by sign · p · 10000^(-2i/d)."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        a, b = pairs(i, d)
        theta = sign * positions.double() * 10000.0 ** (-2 * i / d)  # [n]
        c, s = theta.cos(), theta.sin()
        out[..., a], out[..., b] = x[..., a] * c - x[..., b] * s, x[..., a] * s + x[..., b] * c
    return out


def _half(i, d):
    return i, i + d // 2


def _interleaved(i, d):
    return 2 * i, 2 * i + 1


def _rms(t):
    return t / t.pow(2).mean(-1, keepdim=True).add(torch.finfo(t.dtype).eps).sqrt()


def test_the_minus_theta_styles_are_their_formulas_and_the_bugs_change_them():
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    m = _moved(styles.MinusHalves())
    q, k, v = (lin(x).view(2, 5, -1, 8).transpose(1, 2) for lin in (m.c_q, m.c_k, m.c_v))
    pos = torch.arange(5)
    q, k = _rms(_turned64(q, pos, _half, -1)), _rms(_turned64(k, pos, _half, -1))
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    want = m.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(m(x), want, atol=1e-10)
    assert not torch.allclose(_moved(styles.MinusHalves(bug="tiled"))(x), want, atol=1e-3)
    cache = (torch.randn(2, 2, 3, 8, dtype=torch.float64), torch.randn(2, 2, 3, 8, dtype=torch.float64))
    step = m(x, cache)
    for bug in ("new_first", "no_offset", "is_causal"):
        assert not torch.allclose(_moved(styles.MinusHalves(bug=bug))(x, cache), step, atol=1e-3), bug

    x = torch.randn(2, 5, 24, dtype=torch.float64)
    c = _moved(styles.ConjComplex())
    q, k, v = (lin(x).view(2, 5, 3, 8).transpose(1, 2) for lin in (c.wq, c.wk, c.wv))
    q, k = _turned64(q, pos, _interleaved, -1), _turned64(k, pos, _interleaved, -1)
    want = c.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 5, 24))
    assert torch.allclose(c(x), want, atol=1e-5)  # the complex product runs in float32, as Meta's does
    for bug in ("no_scale", "kv_swapped"):
        assert not torch.allclose(_moved(styles.ConjComplex(bug=bug))(x), want, atol=1e-3), bug

    x = torch.randn(2, 5, 32, dtype=torch.float64)
    r = _moved(styles.MinusRotateHalf())
    q, k, v = (lin(x).view(2, 5, 4, 8).transpose(1, 2) for lin in (r.query, r.key, r.value))
    q, k = _turned64(q, pos, _half, -1), _turned64(k, pos, _half, -1)
    want = r.dense(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(r(x), want, atol=1e-10)
    assert not torch.allclose(_moved(styles.MinusRotateHalf(bug="q_only"))(x), want, atol=1e-3)


MINUS = [("MinusHalves", ()), ("MinusHalves", ("--cache", "3")), ("MinusHalves", ("--cache", "3", "--nq", "1")),
         ("ConjComplex", ()), ("MinusRotateHalf", ())]


@pytest.mark.parametrize(("name", "more"), MINUS, ids=[f"{n}{''.join(m)}" for n, m in MINUS])
def test_rope_by_minus_theta_is_a_convention(runner, name, more):
    result, out = trace(runner, f"{STYLES}:{name}", "--rope", "--causal", *more)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any("turns each pair by −θ" in n and "A convention, not a mistake" in n for n in out["notes"]), out["notes"]


MINUS_BUGS = [("MinusHalves", "tiled", (), "gqa.tiled"), ("MinusHalves", "new_first", ("--cache", "3"), "cache.order"),
              ("MinusHalves", "no_offset", ("--cache", "3"), "rope.positions"),
              ("MinusHalves", "is_causal", ("--cache", "3"), "mask.upper_left"),
              ("ConjComplex", "no_scale", (), "scale.none"), ("ConjComplex", "kv_swapped", (), "kv.swapped")]


@pytest.mark.parametrize(("name", "bug", "more", "experiment"), MINUS_BUGS, ids=[f"{c[0]}-{c[1]}" for c in MINUS_BUGS])
def test_mistakes_in_minus_theta_code_are_named_by_experiment(runner, name, bug, more, experiment):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug='{bug}'", "--rope", "--causal", *more)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == experiment, out["first_divergence"]


def test_q_and_k_turned_opposite_ways_is_no_convention(runner):
    result, out = trace(runner, f"{STYLES}:MinusRotateHalf", "--init", "bug='q_only'", "--rope", "--causal")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert not any("A convention, not a mistake" in n for n in out["notes"]), out["notes"]
