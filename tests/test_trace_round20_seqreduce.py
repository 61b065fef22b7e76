"""`attnscope trace` on attention whose keys and values come from a shorter sequence the module computes from its
input (round 20): Linformer's projections along the sequence (a Parameter `[seq_len, k]` in an einsum, sliced for a
shorter input; a Linear over the tokens of a fused projection's chunk; the input itself compressed before the key and
value projections), Segformer's and PVT's spatial reduction, keys
and values avg-pooled per head after their projection. A weight that contracts the projected tokens is a pooling,
never one of q, k, v or o; the values pooled from the keys' projection are `kv.values_from_keys` by experiment, and
one projection for both where the module holds no other (share_kv) is K = V, a convention.
Styles of its own (tests/trace_styles_round20_seqreduce.py), each checked against F.scaled_dot_product_attention in
float64 and each plant shown to change its output.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from trace_round14_helpers import heads, merged
from trace_round14_helpers import planted as _planted
from tracecases import assert_passes, passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round20_seqreduce.py")
styles = user_module(STYLES)


def _sdpa(q, k, v, h):
    return merged(F.scaled_dot_product_attention(heads(q, h), heads(k, h), heads(v, h)))


def _ln(m, x):
    return F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    bugs = ("no_scale", "scale_twice", "scale_d_model", "softmax_axis", "kv_swapped", "values_from_keys",
            "merge_no_transpose", "split_no_permute")
    with torch.no_grad():
        x = torch.randn(2, 10, 24, generator=g, dtype=torch.float64)
        for init in ({}, {"seq_len": 16}):
            m = styles.EinsumLinformer(**init).double().eval()
            n = x.shape[1]
            e, f = m.proj_k[:n], m.proj_v[:n]
            k = torch.einsum("bnd,nk->bkd", m.to_k(x), e)
            v = torch.einsum("bnd,nk->bkd", m.to_v(x), f)
            want = m.to_out(_sdpa(m.to_q(x), k, v, 3))
            assert torch.allclose(m(x), want, atol=1e-10)
            for bug in bugs:
                assert (_planted(styles.EinsumLinformer, m, bug, x, **init) - want).abs().max() > 1e-2, bug
        shared = styles.EinsumLinformer(share_kv=True).double().eval()  # one projection and one E for both
        k = torch.einsum("bnd,nk->bkd", shared.to_k(x), shared.proj_k)
        assert torch.allclose(shared(x), shared.to_out(_sdpa(shared.to_q(x), k, k, 3)), atol=1e-10)
        for bug in ("no_scale", "softmax_axis", "split_no_permute"):
            assert (_planted(styles.EinsumLinformer, shared, bug, x, share_kv=True) - shared(x)).abs().max() > 1e-2
        one = styles.EinsumLinformer(one_kv_head=True).double().eval()
        k = torch.einsum("bnd,nk->bkd", one.to_k(x), one.proj_k).repeat(1, 1, 3)  # one head for all three
        v = torch.einsum("bnd,nk->bkd", one.to_v(x), one.proj_v).repeat(1, 1, 3)
        assert torch.allclose(one(x), one.to_out(_sdpa(one.to_q(x), k, v, 3)), atol=1e-10)
        for bug in ("values_from_keys", "kv_swapped"):
            assert (_planted(styles.EinsumLinformer, one, bug, x, one_kv_head=True) - one(x)).abs().max() > 1e-2

        mm = styles.MatmulLinformer().double().eval()
        k = (mm.wk(x).transpose(1, 2) @ mm.E).transpose(1, 2)
        v = mm.F.t() @ mm.wv(x)
        want = mm.wo(_sdpa(mm.wq(x), k, v, 3))
        assert torch.allclose(mm(x), want, atol=1e-10)
        for bug in ("no_scale", "kv_swapped", "values_from_keys"):
            assert (_planted(styles.MatmulLinformer, mm, bug, x) - want).abs().max() > 1e-2, bug

        for by_param in (False, True):
            ci = styles.CompressedInput(by_param=by_param).double().eval()
            m = torch.einsum("bnd,nk->bkd", x, ci.E) if by_param else \
                (x.transpose(1, 2) @ ci.compress.weight.T + ci.compress.bias).transpose(1, 2)
            want = ci.o(_sdpa(ci.q(x), ci.k(m), ci.v(m), 3))
            assert torch.allclose(ci(x), want, atol=1e-10)
            for bug in ("no_scale", "kv_swapped", "values_from_keys"):
                assert (_planted(styles.CompressedInput, ci, bug, x, by_param=by_param) - want).abs().max() > 1e-2

        x = torch.randn(2, 12, 32, generator=g, dtype=torch.float64)
        hw = styles.HeadwiseLinformer().double().eval()
        k = torch.einsum("bnd,nk->bkd", hw.k_proj(x), hw.E)  # E mixes each feature's tokens, whichever head
        v = torch.einsum("bnd,nk->bkd", hw.v_proj(x), hw.E)
        want = hw.out_proj(_sdpa(hw.q_proj(x), k, v, 4))
        assert torch.allclose(hw(x), want, atol=1e-10)
        for bug in ("no_scale", "kv_swapped", "values_from_keys", "merge_no_transpose"):
            assert (_planted(styles.HeadwiseLinformer, hw, bug, x) - want).abs().max() > 1e-2, bug

        x = torch.randn(5, 8, 32, generator=g, dtype=torch.float64)
        c = styles.LinearLinformer().double().eval()
        q, k, v = c.qkv(x).split(32, dim=-1)
        k = (k.transpose(1, 2) @ c.E.weight.T + c.E.bias).transpose(1, 2)
        v = (v.transpose(1, 2) @ c.F.weight.T + c.F.bias).transpose(1, 2)
        want = c.out(_sdpa(q, k, v, 4))
        assert torch.allclose(c(x), want, atol=1e-10)
        for bug in bugs:
            assert (_planted(styles.LinearLinformer, c, bug, x) - want).abs().max() > 1e-2, bug

        x = torch.randn(2, 16, 32, generator=g, dtype=torch.float64)
        s = styles.EfficientSelfAttention().double().eval()
        image = x.transpose(1, 2).reshape(2, 32, 4, 4)
        reduced = _ln(s.norm, F.conv2d(image, s.sr.weight, s.sr.bias, stride=2).flatten(2).transpose(1, 2))
        k, v = s.kv(reduced).split(32, dim=-1)
        want = s.proj(_sdpa(s.q(x), k, v, 2))
        assert torch.allclose(s(x, 4, 4), want, atol=1e-10)
        for bug in bugs:
            assert (_planted(styles.EfficientSelfAttention, s, bug, x, 4, 4) - want).abs().max() > 1e-2, bug

        a = styles.AdaptivePoolKV().double().eval()
        pooled = F.adaptive_avg_pool2d(image, 2)
        reduced = F.gelu(_ln(a.norm, F.conv2d(pooled, a.sr.weight, a.sr.bias).flatten(2).transpose(1, 2)))
        want = a.proj(_sdpa(a.q(x), a.k(reduced), a.v(reduced), 4))
        assert torch.allclose(a(x, 4, 4), want, atol=1e-10)
        for bug in bugs[:-1]:
            assert (_planted(styles.AdaptivePoolKV, a, bug, x, 4, 4) - want).abs().max() > 1e-2, bug

        x = torch.randn(2, 8, 24, generator=g, dtype=torch.float64)
        p = styles.PooledKV().double().eval()

        def pairs(t):  # each two neighbouring tokens averaged
            return t.unflatten(1, (4, 2)).mean(2)

        want = p.o_proj(_sdpa(p.q_proj(x), pairs(p.k_proj(x)), pairs(p.v_proj(x)), 2))
        assert torch.allclose(p(x), want, atol=1e-10)
        for bug in ("no_scale", "scale_d_head", "scale_d_model", "kv_swapped", "values_from_keys",
                    "merge_no_transpose"):
            assert (_planted(styles.PooledKV, p, bug, x) - want).abs().max() > 1e-2, bug


LINFORMER, IMAGE = ("--nq", "10"), ("--forward", "H=4, W=4", "--nq", "16")
CORRECT = [("EinsumLinformer", None, LINFORMER),
           ("EinsumLinformer", "seq_len=16", LINFORMER),
           ("EinsumLinformer", "one_kv_head=True", LINFORMER),
           ("EinsumLinformer", "share_kv=True", LINFORMER),
           ("EinsumLinformer", "share_kv=True, one_kv_head=True, seq_len=12", LINFORMER),
           ("MatmulLinformer", None, LINFORMER),
           ("HeadwiseLinformer", None, ("--nq", "12")),
           ("CompressedInput", None, LINFORMER),
           ("CompressedInput", "by_param=True", LINFORMER),
           ("LinearLinformer", None, ("--nq", "8")),
           ("EfficientSelfAttention", None, IMAGE),
           ("AdaptivePoolKV", None, IMAGE),
           ("PooledKV", None, ("--nq", "8"))]


test_correct_styles_pass = passing_test(STYLES, CORRECT)


PLANTED = [("EinsumLinformer", "bug='scale_twice'", LINFORMER, "scale.twice"),
           ("EinsumLinformer", "bug='softmax_axis'", LINFORMER, "softmax.axis"),
           ("EinsumLinformer", "bug='kv_swapped'", LINFORMER, "kv.swapped"),
           ("EinsumLinformer", "bug='values_from_keys'", LINFORMER, "kv.values_from_keys"),
           ("EinsumLinformer", "seq_len=16, bug='values_from_keys'", LINFORMER, "kv.values_from_keys"),
           ("EinsumLinformer", "seq_len=16, bug='kv_swapped'", LINFORMER, "kv.swapped"),
           ("EinsumLinformer", "bug='split_no_permute'", LINFORMER, "heads.split_without_permute"),
           ("EinsumLinformer", "one_kv_head=True, bug='kv_swapped'", LINFORMER, "kv.swapped"),
           ("EinsumLinformer", "one_kv_head=True, bug='values_from_keys'", LINFORMER, "kv.values_from_keys"),
           ("EinsumLinformer", "share_kv=True, bug='softmax_axis'", LINFORMER, "softmax.axis"),
           ("EinsumLinformer", "share_kv=True, bug='split_no_permute'", LINFORMER, "heads.split_without_permute"),
           ("MatmulLinformer", "bug='kv_swapped'", LINFORMER, "kv.swapped"),
           ("MatmulLinformer", "bug='values_from_keys'", LINFORMER, "kv.values_from_keys"),
           ("HeadwiseLinformer", "bug='no_scale'", ("--nq", "12"), "scale.none"),
           ("HeadwiseLinformer", "bug='kv_swapped'", ("--nq", "12"), "kv.swapped"),
           ("HeadwiseLinformer", "bug='values_from_keys'", ("--nq", "12"), "kv.values_from_keys"),
           ("CompressedInput", "bug='kv_swapped'", LINFORMER, "kv.swapped"),
           ("CompressedInput", "bug='values_from_keys'", LINFORMER, "kv.values_from_keys"),
           ("CompressedInput", "by_param=True, bug='no_scale'", LINFORMER, "scale.none"),
           ("CompressedInput", "by_param=True, bug='values_from_keys'", LINFORMER, "kv.values_from_keys"),
           ("LinearLinformer", "bug='scale_d_model'", ("--nq", "8"), "scale.d_model"),
           ("LinearLinformer", "bug='kv_swapped'", ("--nq", "8"), "kv.swapped"),
           ("LinearLinformer", "bug='values_from_keys'", ("--nq", "8"), "kv.values_from_keys"),
           ("LinearLinformer", "bug='merge_no_transpose'", ("--nq", "8"), "heads.merge_without_transpose"),
           ("LinearLinformer", "bug='split_no_permute'", ("--nq", "8"), "heads.split_without_permute"),
           ("EfficientSelfAttention", "bug='no_scale'", IMAGE, "scale.none"),
           ("EfficientSelfAttention", "bug='kv_swapped'", IMAGE, "kv.swapped"),
           ("EfficientSelfAttention", "bug='values_from_keys'", IMAGE, "kv.values_from_keys"),
           ("AdaptivePoolKV", "bug='softmax_axis'", IMAGE, "softmax.axis"),
           ("AdaptivePoolKV", "bug='values_from_keys'", IMAGE, "kv.values_from_keys"),
           ("PooledKV", "bug='scale_d_head'", ("--nq", "8"), "scale.d_head"),
           ("PooledKV", "bug='kv_swapped'", ("--nq", "8"), "kv.swapped"),
           ("PooledKV", "bug='values_from_keys'", ("--nq", "8"), "kv.values_from_keys"),
           ("PooledKV", "bug='merge_no_transpose'", ("--nq", "8"), "heads.merge_without_transpose")]


test_planted_bugs_are_named_by_experiment = plants_test(STYLES, PLANTED)


def test_a_weight_over_the_sequence_is_a_pooling_not_a_projection(runner):
    """Linformer's E `[seq_len, k]`, sliced to the input's length, contracts the projected keys' tokens: the
    reference holds to_q, to_k, to_v and to_out, and the op column shows the einsum the code wrote."""
    code, out = run_case(runner, STYLES, "EinsumLinformer", "seq_len=16", LINFORMER)
    assert_passes(code, out)
    assert "proj_k" not in out["reference"] and "your pooled K, V" in out["reference"], out["reference"]
    ops = [step["op"] for step in out["steps"]]
    assert any("torch.einsum('bnd,nk->bkd', keys, proj_k[0:10])" in op for op in ops), ops
    assert not any("@ proj_k" in op for op in ops), ops


def test_one_projection_for_the_keys_and_the_values_is_a_convention(runner):
    """lucidrains' share_kv: no to_v and no proj_v, the values the keys: read as K = V by the data flow, a note."""
    code, out = run_case(runner, STYLES, "EinsumLinformer", "share_kv=True", LINFORMER)
    assert_passes(code, out)
    assert "k=to_k, v=to_k" in out["reference"] and "K = V" in out["reference"], out["reference"]
