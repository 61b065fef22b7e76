"""Attention whose projections no reference of four Linear layers holds (held-out round 13a: Flux's double- and
single-stream blocks and SD3's joint attention were refused, exit 2). Streams joined along the tokens are now lined
up from the code's joined q, k and v to the merge of the heads (usertrace/joint.py), inputs joined before shared
projections (CogVideoX's) are the reference's input (joint.apply_joined); an output projection that also reads an
MLP's features is the identity, compared up to the merge (reference.merge_only). Each style of
tests/trace_styles_round13_joint.py is checked against F.scaled_dot_product_attention in float64 on its own weights,
passes (exit 0, with its note), and three plants of the catalog in each are named by experiment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round13_joint.py")
styles = user_module(STYLES)


def _lin(layer, x):
    return F.linear(x, layer.weight, layer.bias)


def _heads(t, h):  # [B, T, h·d] -> [B, h, T, d]
    return t.view(*t.shape[:2], h, -1).transpose(1, 2)


def _rms(t, w):  # over each head's features, float64
    return t / t.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * w


def _merge(t):
    return t.transpose(1, 2).flatten(2)


def _moved(module):
    torch.manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return module.double().eval()


def _planted(module, want, *args):
    for bug in module.bugs:
        module.bug = bug
        got = module(*args)
        got = got if isinstance(got, tuple) else (got,)
        assert any(not torch.allclose(g, w, atol=1e-4) for g, w in zip(got, want, strict=True)), bug
    module.bug = None


def test_the_styles_are_sdpa_on_their_own_weights_and_each_plant_changes_them():
    g = torch.Generator().manual_seed(0)
    x, ctx = torch.randn(2, 6, 32, generator=g, dtype=torch.float64), torch.randn(2, 4, 32, generator=g,
                                                                                dtype=torch.float64)
    with torch.no_grad():
        m = _moved(styles.MMDiTJoint())
        q = torch.cat([_rms(_heads(_lin(m.ctx_q, ctx), 4), m.ctx_q_norm.weight),
                       _rms(_heads(_lin(m.to_q, x), 4), m.q_norm.weight)], 2)
        k = torch.cat([_rms(_heads(_lin(m.ctx_k, ctx), 4), m.ctx_k_norm.weight),
                       _rms(_heads(_lin(m.to_k, x), 4), m.k_norm.weight)], 2)
        v = torch.cat([_heads(_lin(m.ctx_v, ctx), 4), _heads(_lin(m.to_v, x), 4)], 2)
        y = _merge(F.scaled_dot_product_attention(q, k, v))
        want = (_lin(m.to_out, y[:, 4:]), _lin(m.ctx_out, y[:, :4]))
        got = m(x, ctx)
        assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(got, want, strict=True))
        m.bugs = ("scale_d_model", "softmax_axis", "kv_swapped", "merge_no_transpose", "split_no_permute")
        _planted(m, want, x, ctx)

        m = _moved(styles.DoubleStream())  # img = x, txt = ctx, joined txt + img, half-split RoPE base 10000
        (iq, ik, iv), (tq, tk, tv) = ((_heads(t, 4) for t in _lin(lin, s).chunk(3, -1))
                                      for lin, s in ((m.img_qkv, x), (m.txt_qkv, ctx)))
        q = torch.cat([_rms(tq, m.txt_qn.weight), _rms(iq, m.img_qn.weight)], 2)
        k = torch.cat([_rms(tk, m.txt_kn.weight), _rms(ik, m.img_kn.weight)], 2)
        v = torch.cat([tv, iv], 2)
        theta = torch.arange(10, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, 8, 2) / 8)
        cos, sin = theta.cos().repeat(1, 2), theta.sin().repeat(1, 2)

        def turned(t):
            return t * cos + torch.cat([-t[..., 4:], t[..., :4]], -1) * sin

        y = _merge(F.scaled_dot_product_attention(turned(q), turned(k), v))
        want = (_lin(m.img_proj, y[:, 4:]), _lin(m.txt_proj, y[:, :4]))
        got = m(x, ctx)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want, strict=True))  # float32 tables
        m.bugs = ("rope_on_v", "scale_twice", "merge_no_transpose")
        _planted(m, want, x, ctx)

        m = _moved(styles.ParallelBlock())
        q, k, v, ff = _lin(m.fused_in, x).split([32, 32, 32, 64], -1)
        y = _merge(F.scaled_dot_product_attention(_heads(q, 4), _heads(k, 4), _heads(v, 4), is_causal=True))
        want = (_lin(m.fused_out, torch.cat([y, F.silu(ff)], -1)),)
        assert torch.allclose(m(x), want[0], atol=1e-10)
        m.bugs = ("mask_after_softmax", "softmax_axis", "merge_no_transpose")
        _planted(m, want, x)

        m = _moved(styles.JoinedFirst())  # the context's tokens, then x's, joined before shared projections
        joined = torch.cat([ctx, x], 1)
        y = _merge(F.scaled_dot_product_attention(*(_heads(_lin(p, joined), 4) for p in (m.to_q, m.to_k, m.to_v))))
        y = _lin(m.to_out, y)
        want = (y[:, 4:], y[:, :4])
        got = m(x, ctx)
        assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(got, want, strict=True))
        m.bugs = ("no_scale", "softmax_axis", "kv_swapped")
        _planted(m, want, x, ctx)

        m = _moved(styles.FlatJoint())  # x's tokens, then the context's, joined before the heads split; GQA 4/2
        q = _heads(torch.cat([_lin(m.wq, x), _lin(m.ctx_wq, ctx)], 1), 4)
        k, v = (_heads(torch.cat(pair, 1), 2).repeat_interleave(2, 1) for pair in zip(
            _lin(m.wkv, x).chunk(2, -1), _lin(m.ctx_wkv, ctx).chunk(2, -1), strict=True))
        y = _merge(F.scaled_dot_product_attention(q, k, v))
        want = (_lin(m.wo, y[:, :6]), _lin(m.ctx_wo, y[:, 6:]))
        got = m(x, ctx)
        assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(got, want, strict=True))
        m.bugs = ("scale_d_head",)
        _planted(m, want, x, ctx)


CORRECT = [("MMDiTJoint", ("--nk", "5"), "joint attention: your code joins 2 streams along the tokens (5 + "),
           ("DoubleStream", ("--rope",), "joint attention: your code joins 2 streams along the tokens ("),
           ("ParallelBlock", ("--causal",), None),
           ("JoinedFirst", ("--nk", "5"), "joint attention: your code joins its inputs along the tokens before"),
           ("FlatJoint", ("--nk", "5"), "joint attention: your code joins 2 streams along the tokens (7 + 5")]


@pytest.mark.parametrize(("name", "args", "note"), CORRECT)
def test_correct_code_lines_up_from_its_joined_q_k_v(runner, name, args, note):
    result, out = trace(runner, f"{STYLES}:{name}", *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["first_divergence"] is None
    if note is not None:
        assert any(n.startswith(note) for n in out["notes"]), out["notes"]
        assert "with identity projections on your joined q, k and v" in out["reference"] or name == "JoinedFirst"
        assert "n_kv_head=2" in out["reference"] or name != "FlatJoint"
    else:
        assert "reads 96 features, the 32 of the merged heads beside others" in out["reference"]


PLANTS = [("MMDiTJoint", ("--nk", "5"), "scale_d_model", "scale.d_model"),
          ("MMDiTJoint", ("--nk", "5"), "softmax_axis", "softmax.axis"),
          ("MMDiTJoint", ("--nk", "5"), "kv_swapped", "kv.swapped"),
          ("MMDiTJoint", ("--nk", "5"), "merge_no_transpose", "heads.merge_without_transpose"),
          ("MMDiTJoint", ("--nk", "5"), "split_no_permute", "heads.split_without_permute"),
          ("DoubleStream", ("--rope",), "rope_on_v", "rope.on_values"),
          ("DoubleStream", ("--rope",), "scale_twice", "scale.twice"),
          ("DoubleStream", ("--rope",), "merge_no_transpose", "heads.merge_without_transpose"),
          ("ParallelBlock", ("--causal",), "mask_after_softmax", "mask.after_softmax"),
          ("ParallelBlock", ("--causal",), "softmax_axis", "softmax.axis"),
          ("ParallelBlock", ("--causal",), "merge_no_transpose", "heads.merge_without_transpose"),
          ("JoinedFirst", ("--nk", "5"), "no_scale", "scale.none"),
          ("JoinedFirst", ("--nk", "5"), "softmax_axis", "softmax.axis"),
          ("JoinedFirst", ("--nk", "5"), "kv_swapped", "kv.swapped"),
          ("FlatJoint", ("--nk", "5"), "scale_d_head", "scale.d_head")]


@pytest.mark.parametrize(("name", "args", "bug", "cause"), PLANTS)
def test_plants_in_the_core_are_named_by_experiment(runner, name, args, bug, cause):
    result, out = trace(runner, f"{STYLES}:{name}", *args, "--init", f"bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == cause and first["evidence"].startswith("by experiment"), first
