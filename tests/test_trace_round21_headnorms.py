"""`attnscope trace` reads a qk-norm held one norm per head (round 21's StableLM: StableLmLayerNormPerHead, a
ModuleList of nn.LayerNorm(d_head) applied over `torch.split(q, 1, dim=1)`, each head through its own, joined by
torch.cat). The reference took unit weights where it found more than one norm a side: 'none of the usual causes
fits' at Q_normed with --qk-norm head, 'RoPE' misread without it. usertrace/headnorms.py reads which head each norm
normalizes from what it is given (a slice of an earlier tensor at that head) and stacks their weights a row per head.
Styles of our own (tests/trace_styles_round21_headnorms.py), each checked against F.scaled_dot_product_attention in
float64 with a half-split RoPE written as complex products; each plant shown to change the output."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test

from attnscope.usertrace import headnorms

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round21_headnorms.py")
styles = user_module(STYLES)


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE as complex products: coordinate i pairs with i + d/2, turned by position · 10000^(-2i/d)."""
    n, d = x.shape[-2], x.shape[-1]
    turn = torch.polar(torch.ones(n, d // 2, dtype=torch.float64),
                       torch.arange(n, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d))
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * turn
    return torch.cat((z.real, z.imag), -1)


def _normed(x: torch.Tensor, norms, axis: int) -> torch.Tensor:
    """Head h of `x` (on `axis`) through norms[h]: a LayerNorm or RMSNorm by its formula, with that norm's weight."""
    parts = []
    for h, norm in enumerate(norms):
        t = x.select(axis, h)
        if isinstance(norm, torch.nn.LayerNorm):
            t = t - t.mean(-1, keepdim=True)
        t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
        parts.append(t + norm.bias if getattr(norm, "bias", None) is not None else t)
    return torch.stack(parts, axis)


def _rows(held: torch.nn.Module) -> list[torch.nn.LayerNorm]:
    """A LayerNorm per head holding row h of a stacked `[n_head, d_head]` weight and bias."""
    rows = [torch.nn.LayerNorm(held.weight.shape[-1], eps=held.eps).double() for _ in range(held.weight.shape[0])]
    with torch.no_grad():
        for h, row in enumerate(rows):
            row.weight.copy_(held.weight[h])
            row.bias.copy_(held.bias[h])
    return rows


def _heads(t: torch.Tensor) -> torch.Tensor:
    return t.view(2, 5, 4, 8).transpose(1, 2)


def _layer(weight: torch.Tensor, bias: torch.Tensor) -> torch.nn.LayerNorm:
    norm = torch.nn.LayerNorm(weight.shape[0], eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(weight)
        norm.bias.copy_(bias)
    return norm


def _made(cls, bug: str = "") -> torch.nn.Module:
    return cls(bug=bug).double().eval()


def test_the_styles_are_attention():
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    m = _made(styles.SplitNorms)
    q = m.q_proj(x).view(2, 5, 4, 8).transpose(1, 2)
    k, v = (p(x).view(2, 5, 2, 8).transpose(1, 2) for p in (m.k_proj, m.v_proj))
    q, k = _rope(_normed(q, m.q_norm.norms, 1)), _rope(_normed(k, m.k_norm.norms, 1))
    want = m.o_proj(F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(m(x), want, atol=1e-10)
    for bug in ("after_rope", "tiled"):
        assert (_made(styles.SplitNorms, bug)(x) - want).abs().max() > 1e-3, bug

    y = torch.randn(2, 5, 24, dtype=torch.float64)
    m = _made(styles.LoopedRMS)
    q, k, v = (w(y).view(2, 5, 3, 8) for w in (m.wq, m.wk, m.wv))
    q, k = _normed(q, m.q_norms, 2).transpose(1, 2), _normed(k, m.k_norms, 2).transpose(1, 2)
    want = m.wo(F.scaled_dot_product_attention(q, k, v.transpose(1, 2)).transpose(1, 2).reshape(2, 5, 24))
    assert torch.allclose(m(y), want, atol=1e-10)
    assert (_made(styles.LoopedRMS, "no_scale")(y) - want).abs().max() > 1e-3

    m = _made(styles.StackedNorm)
    q, k, v = m.qkv(x).view(2, 5, 3, 4, 8).permute(2, 0, 3, 1, 4)
    q, k = _rope(_normed(q, _rows(m.q_norm), 1)), _rope(_normed(k, _rows(m.k_norm), 1))
    want = m.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(m(x), want, atol=1e-10)
    for bug in ("after_rope", "no_scale"):
        assert (_made(styles.StackedNorm, bug)(x) - want).abs().max() > 1e-3, bug

    m = _made(styles.GainList)
    q, k, v = (_heads(p(x)) for p in (m.q, m.k, m.v))
    q = _normed(q, [_layer(w, b) for w, b in zip(m.q_gain, m.q_shift, strict=True)], 1)
    k = _normed(k, [_layer(w, b) for w, b in zip(m.k_gain, m.k_shift, strict=True)], 1)
    want = m.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(m(x), want, atol=1e-10)
    assert (_made(styles.GainList, "no_scale")(x) - want).abs().max() > 1e-3


def test_the_norms_are_trained_and_differ_by_head():
    m = styles.SplitNorms()
    weights = torch.stack([n.weight for n in m.q_norm.norms])
    assert (weights - 1).abs().min() > 1e-4 and (weights[0] - weights[1]).abs().max() > 1e-2


CORRECT = [("SplitNorms", ("--rope", "--qk-norm", "head")),
           ("SplitNorms", ("--rope",)),
           ("LoopedRMS", ("--qk-norm", "head")),
           ("LoopedRMS", ()),
           ("StackedNorm", ("--rope", "--causal", "--qk-norm", "head")),
           ("StackedNorm", ("--rope", "--causal")),
           ("GainList", ("--qk-norm", "head")),
           ("GainList", ())]


test_a_norm_per_head_passes = passing_test(STYLES, [(name, None, options) for name, options in CORRECT])


PLANTS = [("SplitNorms", "after_rope", ("--rope", "--qk-norm", "head"), "qknorm.place"),
          ("SplitNorms", "tiled", ("--rope", "--qk-norm", "head"), "gqa.tiled"),
          ("LoopedRMS", "no_scale", ("--qk-norm", "head"), "scale.none"),
          ("StackedNorm", "after_rope", ("--rope", "--causal", "--qk-norm", "head"), "qknorm.place"),
          ("StackedNorm", "no_scale", ("--rope", "--causal", "--qk-norm", "head"), "scale.none"),
          ("GainList", "no_scale", ("--qk-norm", "head"), "scale.none")]


test_plants_beside_a_norm_per_head_are_named = plants_test(STYLES, [(name, f"bug={bug!r}", options, cause)
                                                                    for name, bug, options, cause in PLANTS])


def test_per_head_stacks_the_norms_in_head_order():
    """PerHead runs head j through norm j, and holds their weights and biases a row per head in that order."""
    norms = [torch.nn.LayerNorm(4).double() for _ in range(3)]
    with torch.no_grad():
        for i, n in enumerate(norms):
            n.weight.fill_(i + 2.0)
            n.bias.fill_(-i - 0.5)
    held = headnorms.PerHead(norms, 4)
    assert torch.equal(held.weight[:, 0], torch.tensor([2.0, 3.0, 4.0], dtype=torch.float64))
    assert torch.equal(held.bias[:, 0], torch.tensor([-0.5, -1.5, -2.5], dtype=torch.float64))
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    assert torch.allclose(held(x)[:, 2], norms[2](x[:, 2]), atol=1e-12)
