"""`attnscope trace` reads a qk-norm beside a RoPE written as complex products, Gemma's (1 + w) gain and a norm over
the whole projection, on either side of the rotation (tests/trace_styles_round22_ropenorms.py). Without --qk-norm,
a norm module (Meta's RMSNorm, Gemma's (1 + w)) on the rotated heads, or one over the whole rotated projection
(OLMo 2's norm moved past RoPE), diverged at the scores unnamed: the reading after the rotation was tried only where
no weightless rows were read first, and the reference had no norm over the projection after RoPE. A gain held as a
bare parameter and left out on one side (`k_scale` never read) left the reference with unit weights. Each style is
checked against F.scaled_dot_product_attention in float64 with a RoPE and norms written here; each plant changes the
output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round22_ropenorms.py")
styles = user_module(STYLES)


def _rope(x: torch.Tensor, pairing: str) -> torch.Tensor:
    """x [.., n, d] turned at positions 0 .. n − 1, base 10000: pairs (i, i + d/2) or (2i, 2i + 1)."""
    n, d = x.shape[-2], x.shape[-1]
    theta = torch.arange(n, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    if pairing == "half":
        a, b = x[..., : d // 2], x[..., d // 2:]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    ra, rb = a * theta.cos() - b * theta.sin(), a * theta.sin() + b * theta.cos()
    return torch.cat((ra, rb), -1) if pairing == "half" else torch.stack((ra, rb), -1).flatten(-2)


def _rms(x: torch.Tensor, gain: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def _heads(t: torch.Tensor, h: int) -> torch.Tensor:
    b, n, w = t.shape
    return t.view(b, n, h, w // h).transpose(1, 2)


def _merged(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).flatten(2)


def _made(cls, **kw) -> torch.nn.Module:
    return cls(**kw).double().eval()


def _meta(m, x, late=False):
    q, k, v = (_heads(w(x), n) for w, n in ((m.wq, 4), (m.wk, 2), (m.wv, 2)))
    norm = lambda t, n: _rms(t, n.weight)  # noqa: E731
    if not late:
        q, k = norm(q, m.q_norm), norm(k, m.k_norm)
    q, k = _rope(q, "interleaved"), _rope(k, "interleaved")
    if late:
        q, k = norm(q, m.q_norm), norm(k, m.k_norm)
    return m.wo(_merged(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)))


def _gemma(m, x, late=False):
    q, k, v = (_heads(w(x), n) for w, n in ((m.q_proj, 4), (m.k_proj, 2), (m.v_proj, 2)))
    norm = lambda t, n: _rms(t, 1 + n.weight)  # noqa: E731
    if not late:
        q, k = norm(q, m.q_norm), norm(k, m.k_norm)
    q, k = _rope(q, "half"), _rope(k, "half")
    if late:
        q, k = norm(q, m.q_norm), norm(k, m.k_norm)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=8.0 ** -0.5)
    return m.o_proj(_merged(out))


def _olmo(m, x, late=False):
    q, k, v = m.q_proj(x), m.k_proj(x), m.v_proj(x)
    if not late:
        q, k = _rms(q, m.q_norm.weight), _rms(k, m.k_norm.weight)
    q, k, v = _rope(_heads(q, 4), "half"), _rope(_heads(k, 4), "half"), _heads(v, 4)
    if late:
        q, k = _heads(_rms(_merged(q), m.q_norm.weight), 4), _heads(_rms(_merged(k), m.k_norm.weight), 4)
    return m.o_proj(_merged(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


def _complex_gemma(m, x, late=False):
    q, k, v = m.qkv(x).view(*x.shape[:2], 3, 4, 8).permute(2, 0, 3, 1, 4)
    if not late:
        q, k = _rms(q, 1 + m.q_scale), _rms(k, 1 + m.k_scale)
    q, k = _rope(q, "interleaved"), _rope(k, "interleaved")
    if late:
        q, k = _rms(q, 1 + m.q_scale), _rms(k, 1 + m.k_scale)
    return m.proj(_merged(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


def _wide_layer(m, x):
    q, k, v = m.qkv(x).chunk(3, dim=-1)
    q, k = (F.layer_norm(t, (24,), n.weight, n.bias, 1e-5) for t, n in ((q, m.norm_q), (k, m.norm_k)))
    return m.out(_merged(F.scaled_dot_product_attention(_heads(q, 3), _heads(k, 3), _heads(v, 3))))


FORMULAS = {"MetaNormed": _meta, "GemmaNormed": _gemma, "OlmoWhole": _olmo, "ComplexGemma": _complex_gemma}


@pytest.mark.parametrize("name", list(FORMULAS))
def test_the_styles_are_attention_and_the_plants_change_it(name):
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    cls = getattr(styles, name)
    for late in (False, True):
        m = _made(cls, late=late)
        assert torch.allclose(m(x), FORMULAS[name](m, x, late), atol=1e-5), late
    for bug in ("after_rope", "no_k_norm") + (("no_norm",) if name == "MetaNormed" else ()):
        m = _made(cls, bug=bug)
        assert (m(x) - FORMULAS[name](m, x)).abs().max() > 1e-2, bug


def test_the_whole_width_layer_norm_is_attention():
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    m = _made(styles.WideLayerNormed)
    assert torch.allclose(m(x), _wide_layer(m, x), atol=1e-5)
    assert (m.norm_q.bias.abs().min() > 1e-4) and (m.norm_k.weight - 1).abs().min() > 1e-4


def test_the_gains_are_trained():
    for m, gains in ((styles.MetaNormed(), ("q_norm.weight", "k_norm.weight")),
                     (styles.GemmaNormed(), ("q_norm.weight", "k_norm.weight")),
                     (styles.ComplexGemma(), ("q_scale", "k_scale"))):
        params = dict(m.named_parameters())
        for name in gains:  # (1 + w) of a Gemma norm is 1 at w = 0: moved off it too
            assert (params[name] - 1).abs().min() > 1e-4 and params[name].abs().min() > 1e-4


META = ("--causal", "--rope", "--rope-pairing", "interleaved")
ROPE = ("--causal", "--rope")
CORRECT = [("MetaNormed", None, (*META, "--qk-norm", "head")),
           ("MetaNormed", "late=True", META),
           ("GemmaNormed", None, (*ROPE, "--qk-norm", "head")),
           ("GemmaNormed", "late=True", ROPE),
           ("OlmoWhole", None, (*ROPE, "--qk-norm", "proj")),
           ("OlmoWhole", "late=True", ROPE),
           ("ComplexGemma", None, (*META, "--qk-norm", "head")),
           ("ComplexGemma", "late=True", META),
           ("WideLayerNormed", None, ("--qk-norm", "proj")),
           ("WideLayerNormed", None, ())]


test_norms_either_side_of_the_rotation_pass = passing_test(STYLES, CORRECT)


PLANTS = [("MetaNormed", "bug='after_rope'", (*META, "--qk-norm", "head"), "qknorm.place"),
          ("MetaNormed", "bug='no_norm'", (*META, "--qk-norm", "head"), "qknorm.missing"),
          ("MetaNormed", "bug='no_k_norm'", META, "qknorm.missing"),
          ("GemmaNormed", "bug='after_rope'", (*ROPE, "--qk-norm", "head"), "qknorm.place"),
          ("GemmaNormed", "bug='no_k_norm', late=True", ROPE, "qknorm.missing"),
          ("OlmoWhole", "bug='after_rope'", (*ROPE, "--qk-norm", "proj"), "qknorm.place"),
          ("OlmoWhole", "bug='no_k_norm', late=True", ROPE, "qknorm.missing"),
          ("ComplexGemma", "bug='after_rope'", (*META, "--qk-norm", "head"), "qknorm.place"),
          ("ComplexGemma", "bug='no_k_norm'", (*META, "--qk-norm", "head"), "qknorm.missing"),
          ("ComplexGemma", "bug='no_k_norm', late=True", META, "qknorm.missing")]

test_norm_mistakes_beside_the_rotation_are_named = plants_test(STYLES, PLANTS)


# --qk-norm telling the other axis than the code's: the module holds no norm of the flag's width, so the reference's
# norm has unit weights; qknorm.axis takes the code's gains (and bias) from its own normed q and k
OTHER_AXIS = [("OlmoWhole", None, (*ROPE, "--qk-norm", "head"), "qknorm.axis"),
              ("WideLayerNormed", None, ("--qk-norm", "head"), "qknorm.axis"),
              ("MetaNormed", None, (*META, "--qk-norm", "proj"), "qknorm.axis"),
              ("GemmaNormed", None, (*ROPE, "--qk-norm", "proj"), "qknorm.axis"),
              ("ComplexGemma", None, (*META, "--qk-norm", "proj"), "qknorm.axis")]

test_the_flag_of_the_other_axis_is_named_by_experiment = plants_test(STYLES, OTHER_AXIS)


def test_the_other_axis_says_the_gains_are_the_codes(runner):
    code, out = run_case(runner, STYLES, "OlmoWhole", None, (*ROPE, "--qk-norm", "head"))
    assert_named(code, out, "qknorm.axis")
    assert "with your norms' gains" in out["first_divergence"]["diagnosis"], out["first_divergence"]
