"""`attnscope trace` on attention that normalizes its rotated q and k and multiplies them by a learned gain per
channel (round 16b's nGPT: `sqk · normalize(RoPE(q))`), in styles of its own (tests/trace_styles_round15_rotgains.py):
the gain, a parameter or computed from one, turns with no rotary pair, so the reference applies the qk-norm after its
rotation, with those gains, and the mistakes beside it are named by experiment.

Each correct style is checked against F.scaled_dot_product_attention in float64 (RoPE as complex rotations, the
norm and the gains written out); each plant is shown to change the output.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from trace_round14_helpers import heads as _heads
from trace_round14_helpers import merged as _merged
from trace_round14_helpers import planted

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round15_rotgains.py")
styles = user_module(STYLES)
ARGS = {"NormalizedBlock": ("--causal", "--rope", "--scale", str(math.sqrt(8))),
        "GainedRmsAfterRope": ("--causal", "--rope"), "ComplexRopeUnitRows": ("--rope", "--scale", "4")}
PLANTS = [("NormalizedBlock", "values_from_keys", "kv.values_from_keys"),
          ("NormalizedBlock", "merge_no_transpose", "heads.merge_without_transpose"),
          ("GainedRmsAfterRope", "softmax_axis", "softmax.axis"),
          ("GainedRmsAfterRope", "merge_no_transpose", "heads.merge_without_transpose"),
          ("ComplexRopeUnitRows", "kv_swapped", "kv.swapped"),
          ("ComplexRopeUnitRows", "softmax_axis", "softmax.axis"),
          ("ComplexRopeUnitRows", "merge_no_transpose", "heads.merge_without_transpose")]


def _rotated(x, interleaved):
    """x [B, H, T, D] turned by RoPE (base 10000) as complex numbers: pairs (2i, 2i + 1) or (i, i + D/2)."""
    d, t = x.shape[-1], x.shape[-2]
    angles = torch.outer(torch.arange(t, dtype=torch.float64), 10000.0 ** (-torch.arange(0, d, 2) / d))
    pairs = x.unflatten(-1, (-1, 2)) if interleaved else x.unflatten(-1, (2, -1)).transpose(-2, -1)
    turned = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * torch.polar(torch.ones_like(angles),
                                                                                        angles))
    return turned.flatten(-2) if interleaved else turned.transpose(-2, -1).flatten(-2)


def _want(m, x):
    """The style's output in float64 by F.scaled_dot_product_attention, its norm after RoPE written out."""
    if isinstance(m, styles.NormalizedBlock):
        q, k, v = (_heads(f(x)) for f in (m.query, m.key, m.value))
        gain = m.s_qk.view(4, 1, 8) / m.s_qk_scale
        q, k = (gain * F.normalize(_rotated(t, True), dim=-1) for t in (q, k))
        return m.c_proj(_merged(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=math.sqrt(8))))
    if isinstance(m, styles.GainedRmsAfterRope):
        q, k, v = (_heads(f(x)) for f in (m.to_q, m.to_k, m.to_v))
        q, k = (g * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)
                for g, t in ((m.q_gain, _rotated(q, False)), (m.k_gain, _rotated(k, False))))
        return m.to_out(_merged(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    q, k, v = (_heads(t) for t in m.wqkv(x).chunk(3, -1))
    q, k = (m.qk_gain * F.normalize(_rotated(t, True), dim=-1) for t in (q, k))
    return m.wo(_merged(F.scaled_dot_product_attention(q, k, v, scale=4.0)))


def test_the_styles_are_sdpa_with_their_gains_after_rope_and_the_plants_change_them():
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        for name in ARGS:
            cls = getattr(styles, name)
            m = cls().double().eval()
            want = _want(m, x)
            assert torch.allclose(m(x), want, atol=1e-9), name
            before = _want_before_rope(m, x) if name == "GainedRmsAfterRope" else None
            assert before is None or (before - want).abs().max() > 1e-3  # the gains do not commute with RoPE
            for style, bug, _ in PLANTS:
                if style == name:
                    assert (planted(cls, m, bug, x) - want).abs().max() > 1e-3, (name, bug)


def _want_before_rope(m, x):
    """GainedRmsAfterRope with its gains applied before the rotation instead: another output."""
    q, k, v = (_heads(f(x)) for f in (m.to_q, m.to_k, m.to_v))
    q, k = (_rotated(g * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6), False)
            for g, t in ((m.q_gain, q), (m.k_gain, k)))
    return m.to_out(_merged(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


@pytest.mark.parametrize("name", list(ARGS))
def test_a_norm_with_gains_after_rope_is_its_convention(runner, name):
    result, out = trace(runner, f"{STYLES}:{name}", *ARGS[name])
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["first_divergence"] is None and out["error"] is None
    assert any(n.startswith("your code normalizes q and k after RoPE") for n in out["notes"]), out["notes"]
    assert "qk-norm (head, after RoPE)" in out["reference"]


@pytest.mark.parametrize(("name", "bug", "cause"), PLANTS, ids=[f"{p[0]}-{p[1]}" for p in PLANTS])
def test_mistakes_beside_the_gains_are_named_by_experiment(runner, name, bug, cause):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug='{bug}'", *ARGS[name])
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == cause, first
    assert first["evidence"].startswith("by experiment"), first
