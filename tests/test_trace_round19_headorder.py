"""`attnscope trace` on the order of the per-head steps between the projections and the scores (round 19's head
order): a qk-norm with weights (and a bias) on the rotated heads, a gain per head (Cohere's `[n_head, d_head]`)
before or after RoPE, OLMo 2's norm over the whole projection; keys and values swapped before RoPE and the norm
where only q, k and v are named (the output projection names no role); two of q, k and v split without the
transpose. Styles of its own (tests/trace_styles_round19_headorder.py), each checked against a float64 formula and
F.scaled_dot_product_attention, each plant shown to change its output and named by experiment.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from trace_round14_helpers import planted as _planted
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round19_headorder.py")
styles = user_module(STYLES)
BUGS = ("kv_swapped", "split_qk", "split_kv", "split_qv")


def _turned(x, pairs):
    """x `[b, h, n, d]` with each pair (the halves, or neighbours) turned by +θ, as a complex product."""
    n, d = x.shape[-2], x.shape[-1]
    theta = torch.outer(torch.arange(n, dtype=torch.float64),
                        1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))  # [n, d / 2]
    turn = torch.polar(torch.ones_like(theta), theta)
    if pairs == "halves":
        z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * turn
        return torch.cat((z.real, z.imag), dim=-1)
    return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (d // 2, 2)).contiguous()) * turn).flatten(-2)


def _heads(t, h):
    return t.unflatten(-1, (h, -1)).transpose(1, 2)  # [b, n, h·d] -> [b, h, n, d]


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _layer(x, w, b=None, eps=1e-5):
    centred = x - x.mean(-1, keepdim=True)
    out = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * w
    return out if b is None else out + b


def _sdpa(q, k, v):
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         is_causal=True)
    return out.transpose(1, 2).flatten(2)  # [b, n, h·d]


def _changed(cls, m, want, x, bugs, **init):
    for bug in bugs:
        assert (_planted(cls, m, bug, x, **init) - want).abs().max() > 1e-2, bug


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        m = styles.RotatedLayerNorm().double().eval()
        q, k, v = _heads(m.q_proj(x), 4), _heads(m.k_proj(x), 2), _heads(m.v_proj(x), 2)
        q = _layer(_turned(q, "halves"), m.q_norm.weight, m.q_norm.bias)  # normed after RoPE
        k = _layer(_turned(k, "halves"), m.k_norm.weight, m.k_norm.bias)
        want = m.proj(_sdpa(q, k, v))
        assert torch.allclose(m(x), want, atol=1e-10)
        _changed(styles.RotatedLayerNorm, m, want, x, BUGS)

        for late in (True, False):
            e = styles.EinsumRmsAfter(late=late).double().eval()
            q, k, v = _heads(e.wq(x), 4), _heads(e.wk(x), 2), _heads(e.wv(x), 2)
            if late:
                q, k = _turned(q, "neighbours"), _turned(k, "neighbours")
                q, k = _rms(q, e.q_norm.weight), _rms(k, e.k_norm.weight)
            else:
                q, k = _rms(q, e.q_norm.weight), _rms(k, e.k_norm.weight)
                q, k = _turned(q, "neighbours"), _turned(k, "neighbours")
            want = e.c_proj(_sdpa(q, k, v))
            assert torch.allclose(e(x), want, atol=1e-10)
            _changed(styles.EinsumRmsAfter, e, want, x, (*BUGS, "kv_swapped_normed"), late=late)

        for late in (False, True):
            c = styles.CohereHeads(late=late).double().eval()
            q, k, v = _heads(c.q_proj(x), 4), _heads(c.k_proj(x), 2), _heads(c.v_proj(x), 2)
            wq, wk = c.q_norm.weight[:, None], c.k_norm.weight[:, None]  # [h, 1, d]: a gain per head
            if late:
                q, k = _layer(_turned(q, "neighbours"), wq), _layer(_turned(k, "neighbours"), wk)
            else:
                q, k = _turned(_layer(q, wq), "neighbours"), _turned(_layer(k, wk), "neighbours")
            want = c.mix(_sdpa(q, k, v))
            assert torch.allclose(c(x), want, atol=1e-5)  # CohereLayerNorm computes in float32
            _changed(styles.CohereHeads, c, want, x, BUGS, late=late)

        a = styles.Anonymous().double().eval()
        q, k, v = _heads(a.lins[0](x), 4), _heads(a.lins[1](x), 2), _heads(a.lins[2](x), 2)
        q, k = _rms(q, a.norms[0].weight), _rms(k, a.norms[1].weight)
        want = a.lins[3](_sdpa(_turned(q, "halves"), _turned(k, "halves"), v))
        assert torch.allclose(a(x), want, atol=1e-10)
        _changed(styles.Anonymous, a, want, x, ("kv_swapped_normed",))

        o = styles.Olmo2Proj().double().eval()
        q = _heads(_rms(o.q_proj(x), o.q_norm.weight), 4)  # normed over the whole projection, then split
        k = _heads(_rms(o.k_proj(x), o.k_norm.weight), 2)
        v = _heads(o.v_proj(x), 2)
        want = o.o_proj(_sdpa(_turned(q, "halves"), _turned(k, "halves"), v))
        assert torch.allclose(o(x), want, atol=1e-10)
        _changed(styles.Olmo2Proj, o, want, x, BUGS)


ROPE = ("--causal", "--rope")
CORRECT = [("RotatedLayerNorm", None), ("EinsumRmsAfter", None), ("EinsumRmsAfter", "late=False"),
           ("CohereHeads", None), ("CohereHeads", "late=True"), ("Olmo2Proj", None), ("Anonymous", None)]


@pytest.mark.parametrize(("target", "init"), CORRECT, ids=case_ids(CORRECT))
def test_correct_styles_pass(runner, target, init):
    assert_passes(*run_case(runner, STYLES, target, init, ROPE))


def test_the_norm_after_rope_is_said(runner):
    code, out = run_case(runner, STYLES, "RotatedLayerNorm", None, ROPE)
    assert_passes(code, out)
    assert any("after RoPE" in n and "your norms' weights" in n for n in out["notes"]), out["notes"]
    assert "qk-norm (head, after RoPE)" in out["reference"], out["reference"]


PLANTS = [("RotatedLayerNorm", "bug='kv_swapped'", "kv.swapped"),
          ("RotatedLayerNorm", "bug='split_qk'", "heads.split_without_permute"),
          ("RotatedLayerNorm", "bug='split_kv'", "heads.split_without_permute"),
          ("RotatedLayerNorm", "bug='split_qv'", "heads.split_without_permute"),
          ("EinsumRmsAfter", "bug='kv_swapped'", "kv.swapped"),
          ("EinsumRmsAfter", "late=False, bug='kv_swapped'", "kv.swapped"),
          ("EinsumRmsAfter", "late=False, bug='kv_swapped_normed'", "kv.swapped"),
          ("EinsumRmsAfter", "bug='split_qk'", "heads.split_without_permute"),
          ("EinsumRmsAfter", "bug='split_kv'", "heads.split_without_permute"),
          ("EinsumRmsAfter", "late=False, bug='split_qv'", "heads.split_without_permute"),
          ("CohereHeads", "bug='kv_swapped'", "kv.swapped"),
          ("CohereHeads", "late=True, bug='kv_swapped'", "kv.swapped"),
          ("CohereHeads", "bug='split_qk'", "heads.split_without_permute"),
          ("CohereHeads", "late=True, bug='split_kv'", "heads.split_without_permute"),
          ("Olmo2Proj", "bug='kv_swapped'", "kv.swapped"),
          ("Olmo2Proj", "bug='split_qk'", "heads.split_without_permute"),
          ("Olmo2Proj", "bug='split_kv'", "heads.split_without_permute"),
          ("Olmo2Proj", "bug='split_qv'", "heads.split_without_permute"),
          ("Anonymous", "bug='kv_swapped_normed'", "kv.swapped")]


@pytest.mark.parametrize(("target", "init", "entry"), PLANTS, ids=case_ids(PLANTS))
def test_plants_are_named_by_experiment(runner, target, init, entry):
    assert_named(*run_case(runner, STYLES, target, init, ROPE), entry)


def test_names_hold_q_k_v_beside_an_output_projection_the_flow_finds(runner):
    code, out = run_case(runner, STYLES, "RotatedLayerNorm", "bug='kv_swapped'", ROPE)
    assert_named(code, out, "kv.swapped")
    assert "k=k_proj, v=v_proj, o=proj" in out["reference"], out["reference"]
