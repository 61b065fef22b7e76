"""`attnscope trace` reads where the code clips q and k (clip_qkv) from its own ops: where the clamp's input is the
qk-norm's output (HF OLMoE's `q_norm(q_proj(x)).clamp_(...)`), the reference clips its Q_normed and K_normed, v after
its projection; where it is a projection's output (DBRX's, OLMo's order), Q_feat, K_feat and V_feat as before. Round
24's OLMoE attention with clip_qkv was a false alarm ('first divergence: K_feat ... none of the usual causes fits').
Styles of our own (tests/trace_styles_round24_clipplace.py), each checked against F.scaled_dot_product_attention in
float64 with RoPE as complex products and the clamp where each style puts it; each plant shown to change the
output."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round24_clipplace.py")
styles = user_module(STYLES)


def _rope(x: torch.Tensor) -> torch.Tensor:
    n, d = x.shape[-2], x.shape[-1]
    angle = torch.arange(n, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat((z.real, z.imag), -1)


def _rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _heads(t: torch.Tensor, h: int) -> torch.Tensor:
    return t.view(t.shape[0], t.shape[1], h, -1).transpose(1, 2)


def _sdpa(q, k, v, wo, rotate=True):
    q, k = (_rope(q), _rope(k)) if rotate else (q, k)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return wo(out.transpose(1, 2).flatten(2))


def _want(name, m, x, c):
    if name == "OlmoeLike":
        q = _rms(m.q_proj(x), m.q_norm.weight, 1e-6).clamp(-c, c)
        k = _rms(m.k_proj(x), m.k_norm.weight, 1e-6).clamp(-c, c)
        return _sdpa(_heads(q, 4), _heads(k, 2), _heads(m.v_proj(x).clamp(-c, c), 2), m.o_proj)
    if name == "DbrxLike":
        q, k, v = m.Wqkv(x).clamp(-c, c).split([32, 16, 16], -1)
        return _sdpa(_heads(q, 4), _heads(k, 2), _heads(v, 2), m.out_proj, rotate=False)
    if name == "OlmoLike":
        q, k, v = m.att_proj(x).clamp(-c, c).chunk(3, -1)
        q, k = (F.layer_norm(t, (24,), w, None, 1e-5) for t, w in ((q, m.q_norm_weight), (k, m.k_norm_weight)))
        return _sdpa(_heads(q, 3), _heads(k, 3), _heads(v, 3), m.attn_out)
    q = _rms(_heads(m.q_proj(x), 4), m.q_norm.weight, 1e-6).clamp(-c, c)
    k = _rms(_heads(m.k_proj(x), 4), m.k_norm.weight, 1e-6).clamp(-c, c)
    return _sdpa(q, k, _heads(m.v_proj(x), 4).clamp(-c, c), m.o_proj)


BOUNDS = {"OlmoeLike": 0.6, "DbrxLike": 0.7, "OlmoLike": 0.9, "HeadNormClip": 0.5}
PLANTED = {"OlmoeLike": ("k_unclipped", "after_rope"), "DbrxLike": ("half_clip",), "OlmoLike": ("no_scale",),
           "HeadNormClip": ("swap_kv",)}


@pytest.mark.parametrize("name", list(BOUNDS))
def test_the_styles_clip_where_they_say(name):
    torch.manual_seed(1)
    x = torch.randn(2, 6, 24 if name == "OlmoLike" else 32, dtype=torch.float64)
    m = getattr(styles, name)().double().eval()
    given = (torch.zeros(6, 6, dtype=torch.float64).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(),
                                                                  float("-inf")),) if name == "OlmoeLike" else ()
    with torch.no_grad():
        want = _want(name, m, x, BOUNDS[name])
        assert torch.allclose(m(x, *given), want, atol=1e-6), (m(x, *given) - want).abs().max()
        assert (_want(name, m, x, 1e9) - want).abs().max() > 1e-3  # the clamp is active on these inputs
        for bug in PLANTED[name]:
            assert (getattr(styles, name)(bug=bug).double().eval()(x, *given) - want).abs().max() > 1e-3, bug


CORRECT = [("OlmoeLike", None, ("--rope", "--causal", "--qk-norm", "proj")),
           ("DbrxLike", None, ("--causal",)),
           ("OlmoLike", None, ("--rope", "--causal", "--qk-norm", "proj")),
           ("HeadNormClip", None, ("--rope", "--causal", "--qk-norm", "head"))]

test_clips_in_either_place_pass = passing_test(STYLES, CORRECT)


@pytest.mark.parametrize(("name", "options", "after_norm"), [(n, o, n in ("OlmoeLike", "HeadNormClip"))
                                                             for n, _, o in CORRECT])
def test_the_clamps_place_is_read_from_its_input(runner, name, options, after_norm):
    code, out = run_case(runner, STYLES, name, None, options)
    assert code == 0
    said = [n for n in out["notes"] if re.search(r"clips q and k to \S+ after their qk-norm", n)]
    assert bool(said) == after_norm, out["notes"]
    if after_norm:  # one place said: not also the config's "after their projection"
        assert not [n for n in out["notes"] if "clipped to" in n and "after their projection" in n], out["notes"]


PLANTS = [("OlmoLike", "bug='no_scale'", ("--rope", "--causal", "--qk-norm", "proj"), "scale.none"),
          ("HeadNormClip", "bug='swap_kv'", ("--rope", "--causal", "--qk-norm", "head"), "kv.swapped")]

test_mistakes_beside_a_clip_are_named = plants_test(STYLES, PLANTS)


@pytest.mark.parametrize(("name", "bug", "options", "step"), [
    ("OlmoeLike", "k_unclipped", ("--rope", "--causal", "--qk-norm", "proj"), "K_"),  # k's clamp missing
    ("OlmoeLike", "after_rope", ("--rope", "--causal", "--qk-norm", "proj"), "K_feat"),  # not after the norm
    ("DbrxLike", "half_clip", ("--causal",), "Q_feat"),
])
def test_a_missing_or_misplaced_clip_diverges_where_it_is_left_out(runner, name, bug, options, step):
    code, out = run_case(runner, STYLES, name, f"bug='{bug}'", options)
    assert code == 1
    assert out["first_divergence"]["reference"].startswith(step), out["first_divergence"]
