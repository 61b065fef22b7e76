"""`attnscope trace` on attention whose values are not as wide as its queries and keys (d_K ≠ d_V per head), and
whose keys' and values' side has an input norm of its own (round 19's Perceiver IO cross-attention: qk_channels ≠
v_channels, layernorm2 on its inputs): the reference holds d_K per head for q and k and d_V for v and o, as the
projections' widths and the head split say, in self- and cross-attention, with grouped heads and RoPE; a norm the
keys' and values' projections read beside the module's own queries is their input side. Styles of its own
(tests/trace_styles_round19_dv.py), each checked against F.scaled_dot_product_attention in float64 and each plant
shown to change its output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from torch import nn
from trace_round14_helpers import heads, merged, padding_file
from trace_round14_helpers import planted as _planted
from tracecases import assert_named, assert_passes, case_ids, run_case

from attnscope.attention.multihead import MultiHeadAttention
from attnscope.errors import UsageError
from attnscope.usertrace.reference import head_widths

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round19_dv.py")
styles = user_module(STYLES)


def _ln(m, x):
    return F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)


def _rotated(x, base=10000.0):
    """x `[b, h, n, d]` with its halves turned as complex numbers, θ = position · base^(-2i/d)."""
    n, d = x.shape[-2], x.shape[-1]
    theta = torch.outer(torch.arange(n, dtype=torch.float64),
                        1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * torch.polar(torch.ones_like(theta), theta)
    return torch.cat((z.real, z.imag), dim=-1)


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 5:] = False
    with torch.no_grad():
        m = styles.LatentReader().double().eval()
        data = torch.randn(2, 7, 12, generator=g, dtype=torch.float64)
        q = m.to_q(_ln(m.norm_latents, m.latents)).expand(2, -1, -1)
        kv = m.to_kv(_ln(m.norm_context, data))
        k, v = kv[..., :18], kv[..., 18:]  # 3 heads of 6 for the keys, of 4 for the values
        want = m.to_out(merged(F.scaled_dot_product_attention(heads(q, 3), heads(k, 3), heads(v, 3),
                                                              attn_mask=keep[:, None, None, :])))
        assert torch.allclose(m(data, keep), want, atol=1e-10)
        for bug in ("scale_v", "softmax_axis", "merge_no_permute", "no_scale"):
            assert (_planted(styles.LatentReader, m, bug, data, keep) - want).abs().max() > 1e-2, bug

        c = styles.ContextCross().double().eval()
        x = torch.randn(2, 5, 32, generator=g, dtype=torch.float64)
        encoder = torch.randn(2, 7, 20, generator=g, dtype=torch.float64)
        context = _ln(c.norm_cross, encoder)
        q, k, v = heads(c.to_q(x)), heads(c.to_k(context)), heads(c.to_v(context))
        want = c.to_out[0](merged(F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])))
        assert torch.allclose(c(x, encoder, keep), want, atol=1e-10)  # exp(-10000) is 0 in float64 too
        for bug in ("scale_v", "softmax_axis", "merge_no_permute", "mask_polarity"):
            assert (_planted(styles.ContextCross, c, bug, x, encoder, keep) - want).abs().max() > 1e-2, bug

        w = styles.WideValues().double().eval()
        x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
        q, k, v = heads(w.q_proj(x)), heads(w.k_proj(x), 2), heads(w.v_proj(x), 2)
        q, k = _rotated(q), _rotated(k)
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
        want = w.o_proj(merged(out))
        assert torch.allclose(w(x), want, atol=1e-5)  # the rotary table is float32's
        for bug in ("scale_v", "tiled", "merge_no_permute"):
            assert (_planted(styles.WideValues, w, bug, x) - want).abs().max() > 1e-2, bug

        a = styles.NaiveMla().double().eval()
        q = heads(a.q_proj(x))  # [2, 4, 7, 6 + 4]
        latent, k_pe = a.kv_a_proj_with_mqa(x).split([12, 4], dim=-1)
        latent = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + 1e-6) * a.kv_a_layernorm.weight
        k_nope, v = heads(a.kv_b_proj(latent)).split([6, 5], dim=-1)
        q = torch.cat((q[..., :6], _rotated(q[..., 6:])), dim=-1)
        k = torch.cat((k_nope, _rotated(k_pe[:, None]).expand(2, 4, 7, 4)), dim=-1)
        want = a.o_proj(merged(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        assert torch.allclose(a(x), want, atol=1e-5)
        for bug in ("scale_v", "no_scale", "softmax_axis", "merge_no_permute"):
            assert (_planted(styles.NaiveMla, a, bug, x) - want).abs().max() > 1e-2, bug

        c = styles.CachedValues().double().eval()
        cache = (torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64),
                 torch.randn(2, 4, 3, 6, generator=g, dtype=torch.float64))
        k = torch.cat((cache[0], heads(c.k_proj(x))), dim=2)
        v = torch.cat((cache[1], heads(c.v_proj(x))), dim=2)
        allowed = torch.arange(10)[None, :] <= torch.arange(3, 10)[:, None]  # query i sits at position 3 + i
        want = c.o_proj(merged(F.scaled_dot_product_attention(heads(c.q_proj(x)), k, v, attn_mask=allowed)))
        assert torch.allclose(c(x, cache), want, atol=1e-10)
        for bug in ("scale_v", "upper_left"):
            assert (_planted(styles.CachedValues, c, bug, x, cache) - want).abs().max() > 1e-2, bug


@pytest.fixture(scope="module")
def pad(tmp_path_factory):
    return str(padding_file(tmp_path_factory.mktemp("pad"), 5))


PADDED = ("--batch", "2", "--nk", "7", "--mask")
CORRECT = [("LatentReader", None, PADDED), ("ContextCross", None, PADDED), ("WideValues", None, ("--rope", "--causal")),
           ("NaiveMla", None, ("--rope", "--causal")), ("CachedValues", None, ("--causal", "--cache", "3"))]


@pytest.mark.parametrize(("target", "init", "options"), CORRECT, ids=case_ids(CORRECT))
def test_correct_styles_pass(runner, pad, target, init, options):
    options = (*options, pad) if options[-1] == "--mask" else options
    assert_passes(*run_case(runner, STYLES, target, init, options))


PLANTS = [("LatentReader", "scale_v", PADDED, "scale.n"),
          ("LatentReader", "softmax_axis", PADDED, "softmax.axis"),
          ("LatentReader", "merge_no_permute", PADDED, "heads.merge_without_transpose"),
          ("LatentReader", "no_scale", PADDED, "scale.none"),
          ("ContextCross", "scale_v", PADDED, "scale.n"),
          ("ContextCross", "softmax_axis", PADDED, "softmax.axis"),
          ("ContextCross", "merge_no_permute", PADDED, "heads.merge_without_transpose"),
          ("ContextCross", "mask_polarity", PADDED, "mask.polarity"),
          ("WideValues", "scale_v", ("--rope", "--causal"), "scale.n"),
          ("WideValues", "tiled", ("--rope", "--causal"), "gqa.tiled"),
          ("WideValues", "merge_no_permute", ("--rope", "--causal"), "heads.merge_without_transpose"),
          ("NaiveMla", "scale_v", ("--rope", "--causal"), "scale.n"),
          ("NaiveMla", "no_scale", ("--rope", "--causal"), "scale.none"),
          ("NaiveMla", "softmax_axis", ("--rope", "--causal"), "softmax.axis"),
          ("CachedValues", "scale_v", ("--causal", "--cache", "3"), "scale.n"),
          ("CachedValues", "upper_left", ("--causal", "--cache", "3"), "mask.upper_left")]


@pytest.mark.parametrize(("target", "bug", "options", "entry"), PLANTS, ids=case_ids(PLANTS))
def test_plants_are_named_by_experiment(runner, pad, target, bug, options, entry):
    options = (*options, pad) if options[-1] == "--mask" else options
    assert_named(*run_case(runner, STYLES, target, f"bug='{bug}'", options), entry)


def test_the_values_width_and_the_keys_own_norm_are_read(runner, pad):
    code, out = run_case(runner, STYLES, "LatentReader", None, (*PADDED, pad))
    assert_passes(code, out)
    assert "d_head=6, d_V=4" in out["reference"], out["reference"]
    assert any("the keys' and values' projections" in n and "norm_context" in n for n in out["notes"]), out["notes"]
    code, out = run_case(runner, STYLES, "LatentReader", "bug='scale_v'", (*PADDED, pad))
    assert "√d_V" in assert_named(code, out, "scale.n")["diagnosis"]


def test_the_reference_holds_d_v_as_sdpa_does():
    g = torch.Generator().manual_seed(1)
    ref = MultiHeadAttention(16, 4, d_head=6, d_v=5, n_kv_head=2, d_kv_in=10, dtype=torch.float64).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        x, ctx = torch.randn(2, 3, 16, generator=g, dtype=torch.float64), torch.randn(2, 4, 10, generator=g,
                                                                                    dtype=torch.float64)
        trace = ref(x, ctx, ctx)
        q, k, v = heads(ref.W_q(x)), heads(ref.W_k(ctx), 2), heads(ref.W_v(ctx), 2)
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
        assert torch.allclose(trace["x"], ref.W_o(merged(out)), atol=1e-12)
    assert trace.step("V_split").dims[-1] == "d_V" and trace.step("K_split").dims[-1] == "d_head"
    assert trace.step("x_rsh1").dims[-1] == "d_V"
    keys, values = ref.empty_cache(2)
    assert values.shape[-1] == 5 and ref(x, ctx, ctx, cache=(keys, values))["V_cat"].shape[-1] == 5
    with pytest.raises(UsageError, match=r"V_cache is \[2, 2, 0, 6\] but the cache is \[n_batch, n_kv_head, "
                                         r"n_cache, d_V\]"):
        ref(x, ctx, ctx, cache=(keys, keys))


def _linears(q, k, v, o):
    return tuple(nn.Linear(i, j) for i, j in ((8, q), (8, k), (8, v), (o, 8)))


def test_a_layout_no_head_split_reads_is_refused_saying_which_width():
    names = {"q": "query", "k": "key", "v": "value", "o": "dense"}
    assert head_widths(names, _linears(32, 32, 24, 24), 4) == (8, 4, 6)
    assert head_widths(names, _linears(32, 16, 24, 48), 4) == (8, 2, 12)
    with pytest.raises(UsageError, match="value writes 24 features and dense reads 20: not one value width per head"):
        head_widths(names, _linears(32, 32, 24, 20), 4)
    with pytest.raises(UsageError, match="key writes 12 features, not a whole number of heads of d_head = 8"):
        head_widths(names, _linears(32, 12, 24, 24), 4)
    with pytest.raises(UsageError, match="query writes 30 features, which 4 heads do not split evenly"):
        head_widths(names, _linears(30, 32, 24, 24), 4)
