"""`attnscope trace --qk-norm head` with a per-head norm held and never called (round 27's StableLM: the keys'
StableLmLayerNormPerHead, a ModuleList of a LayerNorm per head, left out of the forward). The reference read the
queries' per-head norms from the run and found the keys' list under no role (`k_layernorm.norms.0` names none), so it
normalized with unit weights: 'none of the usual causes fits' at Q_normed, whose queries the code normalizes right.
Now the norms held in a container and never called are read per head at their index (headnorms.py) under the role
of the module above them (refbuild.py), and the side left out is `qknorm.missing` by experiment. Styles of our own
(tests/trace_styles_round27_headnorm.py), each checked against F.scaled_dot_product_attention in float64 after the
norms' formulas; each plant shown to change the output."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round27_headnorm.py")
styles = user_module(STYLES)


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE as complex products: coordinate i pairs with i + d/2, turned by position · 10000^(-2i/d)."""
    n, d = x.shape[-2], x.shape[-1]
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    turn = torch.polar(torch.ones(n, d // 2, dtype=torch.float64), torch.arange(n, dtype=torch.float64)[:, None] * inv)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * turn
    return torch.cat((z.real, z.imag), -1)


def _layer(x: torch.Tensor, weights: torch.Tensor, eps: float) -> torch.Tensor:
    """Head h of `x` [b, heads, n, d] as LayerNorm (no bias) with weights[h]: (x - mean) / sqrt(var + eps) · w."""
    x = x - x.mean(-1, keepdim=True)
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weights[:, None, :]


def _rms(x: torch.Tensor, weights: torch.Tensor, eps: float) -> torch.Tensor:
    """Head h of `x` [b, heads, n, d] as RMSNorm with weights[h] (one row shared by every head: broadcast)."""
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weights.reshape(-1, 1, weights.shape[-1])


def _made(cls, bug: str = "") -> torch.nn.Module:
    return cls(bug=bug).double().eval()


def _want(m: torch.nn.Module, x: torch.Tensor, norm, rope: bool) -> torch.Tensor:
    q = m.q_proj(x).view(2, 5, 4, 8).transpose(1, 2)
    k, v = (p(x).view(2, 5, 2, 8).transpose(1, 2) for p in (m.k_proj, m.v_proj))
    q, k = norm(q, m.q_layernorm), norm(k, m.k_layernorm)
    if rope:
        q, k = _rope(q), _rope(k)
    return m.o_proj(F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).reshape(2, 5, 32))


def _stacked(held: torch.nn.Module) -> torch.Tensor:
    return torch.stack([n.weight for n in held.norms])


KINDS = [(styles.ListPerHead, lambda x, n: _layer(x, _stacked(n), 1e-5), True, "after_rope"),
         (styles.SharedNorm, lambda x, n: _rms(x, n.weight, 1e-6), True, "after_rope"),
         (styles.RowNorm, lambda x, n: _rms(x, n.weight, 1e-6), False, "no_scale")]


def test_the_styles_are_attention():
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    for cls, norm, rope, third in KINDS:
        m = _made(cls)
        want = _want(m, x, norm, rope)
        assert torch.allclose(m(x), want, atol=1e-10), cls.__name__
        for bug in ("k_unnormed", "q_unnormed", third):
            m.bug = bug  # the same weights, the plant's forward
            assert (m(x) - want).abs().max() > 1e-3, (cls.__name__, bug)


def test_the_norms_are_trained_and_differ_by_head():
    m = styles.ListPerHead()
    for held, heads in ((m.q_layernorm, 4), (m.k_layernorm, 2)):
        weights = _stacked(held)
        assert weights.shape[0] == heads and (weights - 1).abs().min() > 1e-4
        assert (weights[0] - weights[1]).abs().max() > 1e-2
    rows = styles.RowNorm().k_layernorm.weight
    assert rows.shape == (2, 8) and (rows[0] - rows[1]).abs().max() > 1e-2


HEAD = ("--qk-norm", "head")
OPTIONS = {"ListPerHead": ("--rope", *HEAD), "SharedNorm": ("--rope", *HEAD), "RowNorm": HEAD}

test_a_per_head_norm_with_grouped_keys_passes = passing_test(
    STYLES, [(name, None, options) for name, options in OPTIONS.items()])

PLANTS = [(name, bug, cause) for name in OPTIONS for bug, cause in
          (("k_unnormed", "qknorm.missing"), ("q_unnormed", "qknorm.missing"))] + \
    [("ListPerHead", "after_rope", "qknorm.place"), ("SharedNorm", "after_rope", "qknorm.place"),
     ("RowNorm", "no_scale", "scale.none")]

test_a_side_left_unnormed_is_named = plants_test(
    STYLES, [(name, f"bug={bug!r}", OPTIONS[name], cause) for name, bug, cause in PLANTS])
