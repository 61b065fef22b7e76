"""`attnscope trace` on query/key norms in the places and forms real code puts them (round 20's norms): OLMo 2's norm
over the whole projection written by hand, `nn.LayerNorm((n_head, d_head))` (one norm over the whole projection, a
2-D weight and bias), Llama 4's weightless L2 norm after RoPE and its NoPE layers, Gemma 3's `(1 + w)` RMSNorm with
`query_pre_attn_scalar`, SD3's joint attention with a norm per stream, and a head count kept as `self.h` beside a
KV cache. Styles of its own (tests/trace_styles_round20_norms.py), each checked against a float64 formula and
F.scaled_dot_product_attention, each plant shown to change its output and named by experiment (the qk-norm's
mistakes by the catalog's qknorm.* entries: a side never normalized, the norm on the other side of RoPE or over the
other axis where --qk-norm says where, the values normalized too).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from trace_round14_helpers import planted as _planted
from tracecases import assert_passes, passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round20_norms.py")
styles = user_module(STYLES)


def _turned(x, pairs, start=0):
    """x `[b, h, n, d]` with each pair (the halves, or neighbours) turned by +θ = position · 10000^(-2i/d)."""
    n, d = x.shape[-2], x.shape[-1]
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    theta = torch.arange(start, start + n, dtype=torch.float64)[:, None] * inv  # [n, d / 2]
    if pairs == "halves":
        a, b = x[..., : d // 2], x[..., d // 2:]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    c, s = theta.cos(), theta.sin()
    ra, rb = a * c - b * s, a * s + b * c
    return torch.cat((ra, rb), -1) if pairs == "halves" else torch.stack((ra, rb), -1).flatten(-2)


def _heads(t, h):
    return t.unflatten(-1, (h, -1)).transpose(1, 2)  # [b, n, h·d] -> [b, h, n, d]


def _rms(x, g, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def _layer(x, w, b, eps=1e-5):
    centred = x - x.mean(-1, keepdim=True)
    return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * w + b


def _sdpa(q, k, v, causal=True, scale=None):
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         is_causal=causal, scale=scale)
    return out.transpose(1, 2).flatten(2)  # [b, n, h·d]


def _changed(cls, m, want, args, bugs, **init):
    for bug in bugs:
        got = _planted(cls, m, bug, *args, **init)
        got = got[0] if isinstance(got, tuple) else got
        assert (got - want).abs().max() > 1e-2, bug


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        p = styles.ProjNormAttention().double().eval()
        q = _heads(_rms(p.query(x), p.q_ln.scale), 4)  # normed over the whole projection, then split
        k = _heads(_rms(p.key(x), p.k_ln.scale), 2)
        want = p.dense(_sdpa(_turned(q, "neighbours"), _turned(k, "neighbours"), _heads(p.value(x), 2)))
        assert torch.allclose(p(x), want, atol=1e-5)  # its norm computes in float32
        _changed(styles.ProjNormAttention, p, want, (x,), ("norm_late", "per_head", "norm_v", "no_k_norm",
                                                           "kv_swapped"))
        half = styles.ProjNormAttention(half=True).double().eval()
        half.load_state_dict(p.state_dict())
        want = p.dense(_sdpa(_turned(q, "halves"), _turned(k, "halves"), _heads(p.value(x), 2)))
        assert torch.allclose(half(x), want, atol=1e-5)
        _changed(styles.ProjNormAttention, half, want, (x,), ("norm_late", "per_head", "norm_v", "no_k_norm"),
                 half=True)

        h = styles.HeadGridNorm().double().eval()
        w, b = h.q_norm.weight.flatten(), h.q_norm.bias.flatten()  # one norm over all n_head·d_head cells
        q = _heads(_layer(h.wq(x), w, b), 4)
        k = _heads(_layer(h.wk(x), h.k_norm.weight.flatten(), h.k_norm.bias.flatten()), 4)
        want = h.wo(_sdpa(_turned(q, "halves"), _turned(k, "halves"), _heads(h.wv(x), 4)))
        assert torch.allclose(h(x), want, atol=1e-10)
        _changed(styles.HeadGridNorm, h, want, (x,), ("norm_late", "no_k_norm", "kv_swapped", "per_head"))

        for rope in (True, False):
            m = styles.L2NormLayer(rope=rope).double().eval()
            q, k, v = _heads(m.q_proj(x), 4), _heads(m.k_proj(x), 2), _heads(m.v_proj(x), 2)
            if rope:  # weightless, after RoPE; a NoPE layer neither rotates nor norms
                q, k = _rms(_turned(q, "neighbours"), 1, 1e-5), _rms(_turned(k, "neighbours"), 1, 1e-5)
            want = m.o_proj(_sdpa(q, k, v))
            assert torch.allclose(m(x), want, atol=1e-5)  # its softmax runs in float32
            _changed(styles.L2NormLayer, m, want, (x,), ("tiled", "no_scale", *(("no_k_norm", "norm_v") if rope
                                                                                 else ())), rope=rope)

        m = styles.GemmaHeads().double().eval()
        q = _turned(_rms(_heads(m.q_proj(x), 4), 1 + m.q_norm.weight), "halves")  # Gemma's (1 + w), before RoPE
        k = _turned(_rms(_heads(m.k_proj(x), 2), 1 + m.k_norm.weight), "halves")
        want = m.o_proj(_sdpa(q, k, _heads(m.v_proj(x), 2), scale=16 ** -0.5))  # query_pre_attn_scalar = 16
        assert torch.allclose(m(x), want, atol=1e-5)
        _changed(styles.GemmaHeads, m, want, (x,), ("norm_late", "scale_dhead", "kv_swapped", "no_k_norm", "whole",
                                                     "norm_v"))

        j = styles.JointNorms().double().eval()
        c = torch.randn(2, 5, 24, generator=g, dtype=torch.float64)
        q = torch.cat((_rms(_heads(j.to_q(x), 4), j.norm_q.weight), _rms(_heads(j.add_q_proj(c), 4),
                                                                         j.norm_added_q.weight)), 2)
        k = torch.cat((_rms(_heads(j.to_k(x), 4), j.norm_k.weight), _rms(_heads(j.add_k_proj(c), 4),
                                                                         j.norm_added_k.weight)), 2)
        v = torch.cat((_heads(j.to_v(x), 4), _heads(j.add_v_proj(c), 4)), 2)
        y = _sdpa(q, k, v, causal=False)
        img, ctx = j(x, c)
        assert torch.allclose(img, j.to_out(y[:, :7]), atol=1e-10)
        assert torch.allclose(ctx, j.to_add_out(y[:, 7:]), atol=1e-10)
        _changed(styles.JointNorms, j, j.to_out(y[:, :7]), (x, c), ("no_k_norm", "norm_v", "kv_swapped"))

        m = styles.CachedHeads().double().eval()
        past = (torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64),
                torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64))
        q = _turned(_rms(_heads(m.q(x), 4), m.qn.weight), "halves", 3)
        kv = m.kv(x).unflatten(-1, (2, 4, 8))
        k = torch.cat((past[0], _turned(_rms(kv[:, :, 0].transpose(1, 2), m.kn.weight), "halves", 3)), 2)
        v = torch.cat((past[1], kv[:, :, 1].transpose(1, 2)), 2)
        allowed = torch.ones(7, 10, dtype=torch.bool).tril(3)  # the new rows see the cache and up to themselves
        want = m.o(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).flatten(2))
        assert torch.allclose(m(x, past)[0], want, atol=1e-10)
        _changed(styles.CachedHeads, m, want, (x, past), ("no_k_norm", "kv_swapped", "norm_v"))


ROPE = ("--causal", "--rope")
PROJ = (*ROPE, "--qk-norm", "proj")
HALF = "half=True"
GEMMA = (*ROPE, "--qk-norm", "head", "--scale", "0.25")  # query_pre_attn_scalar ** -0.5, the config's
CACHE = (*ROPE, "--cache", "3", "--qk-norm", "head")
CORRECT = [("ProjNormAttention", None, PROJ), ("ProjNormAttention", None, ROPE), ("ProjNormAttention", HALF, PROJ),
           ("HeadGridNorm", None, PROJ), ("HeadGridNorm", None, ROPE),
           ("L2NormLayer", None, ROPE), ("L2NormLayer", "rope=False", ("--causal",)),
           ("GemmaHeads", None, GEMMA), ("GemmaHeads", None, (*ROPE, "--scale", "0.25")),
           ("JointNorms", None, ("--qk-norm", "head")), ("CachedHeads", None, CACHE),
           ("CachedHeads", "h=2", (*ROPE, "--cache", "3"))]


test_correct_styles_pass = passing_test(STYLES, CORRECT)


def test_a_layer_norm_over_the_head_grid_is_the_projections_norm(runner):
    code, out = run_case(runner, STYLES, "HeadGridNorm", None, PROJ)
    assert_passes(code, out)
    assert "qk-norm (proj)" in out["reference"], out["reference"]
    normed = [a for a in out["alignment"] if a["reference"] in ("Q_normed", "K_normed")]
    assert len(normed) == 2 and all(a["dims"][-1] == "d_feat" and a["max_abs_diff"] < 1e-4 for a in normed), normed


# the catalog's qk-norm entries, each planted in three styles or more (test_trace_catalog counts them)
PLANTED: dict[str, list[tuple[str, str, tuple[str, ...]]]] = {
    "qknorm.missing": [("ProjNormAttention", f"{HALF}, bug='no_k_norm'", PROJ),
                       ("HeadGridNorm", "bug='no_k_norm'", PROJ),
                       ("L2NormLayer", "bug='no_k_norm'", ROPE),
                       ("GemmaHeads", "bug='no_k_norm'", GEMMA),
                       ("CachedHeads", "bug='no_k_norm'", CACHE)],
    "qknorm.place": [("ProjNormAttention", "bug='norm_late'", PROJ),
                     ("ProjNormAttention", f"{HALF}, bug='norm_late'", PROJ),
                     ("HeadGridNorm", "bug='norm_late'", PROJ),
                     ("GemmaHeads", "bug='norm_late'", GEMMA)],
    "qknorm.axis": [("ProjNormAttention", "bug='per_head'", PROJ),
                    ("ProjNormAttention", f"{HALF}, bug='per_head'", PROJ),
                    ("HeadGridNorm", "bug='per_head'", PROJ),
                    ("GemmaHeads", "bug='whole'", GEMMA)],
    "qknorm.on_values": [("ProjNormAttention", f"{HALF}, bug='norm_v'", PROJ),
                         ("L2NormLayer", "bug='norm_v'", ROPE),
                         ("GemmaHeads", "bug='norm_v'", GEMMA),
                         ("CachedHeads", "bug='norm_v'", CACHE)],
}
PLANTS = [("ProjNormAttention", "bug='kv_swapped'", PROJ, "kv.swapped"),
          ("HeadGridNorm", "bug='kv_swapped'", PROJ, "kv.swapped"),
          ("L2NormLayer", "bug='tiled'", ROPE, "gqa.tiled"),
          ("L2NormLayer", "bug='no_scale'", ROPE, "scale.none"),
          ("GemmaHeads", "bug='scale_dhead'", GEMMA, "scale.none"),
          ("GemmaHeads", "bug='kv_swapped'", GEMMA, "kv.swapped"),
          ("CachedHeads", "bug='kv_swapped'", CACHE, "kv.swapped"),
          *((target, init, options, entry) for entry, cases in PLANTED.items() for target, init, options in cases)]


test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


def test_a_norm_the_code_puts_after_rope_is_its_convention_where_no_flag_says_where(runner):
    """qknorm.place and qknorm.axis name a norm's place only where --qk-norm told it: read from the code (no flag),
    Llama 4's weightless norm after RoPE is the code's own."""
    code, out = run_case(runner, STYLES, "L2NormLayer", None, ROPE)
    assert_passes(code, out)
    assert out["params"]["qk_norm_read"] == "head", out["params"]
