"""`attnscope trace` names RoPE's mistakes in multi-head latent attention by experiment (round 20's DeepSeek-V2:
the rotary parts never turned, or a decode step's positions from 0 with a transformers Cache, were 'none of the
usual causes fits', the divergence paired with a tensor of another shape and the same size). The RoPE trials now
turn the part of each head the reference turns (roperead.latent_rope: Q_pe and the shared key part, read from the
reference's data flow, the no-RoPE part passed through), the rotated query part lines up only with a tensor made
from the code's heads, and of DeepSeek's rotary forms the one the code turns its pairs in is read. Styles of our own
(tests/trace_styles_round22_mlarope.py), each checked against F.scaled_dot_product_attention in float64 (a decode
step against the whole sequence's last rows); each plant changes the output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, case_ids, passing_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round22_mlarope.py")
styles = user_module(STYLES)


def _rope(x: torch.Tensor, pairing: str, base: float = 10000.0) -> torch.Tensor:
    """x [.., n, d] turned at positions 0 .. n − 1: pairs (i, i + d/2) or (2i, 2i + 1)."""
    n, d = x.shape[-2], x.shape[-1]
    theta = torch.arange(n, dtype=torch.float64)[:, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = (x[..., : d // 2], x[..., d // 2:]) if pairing == "half" else (x[..., 0::2], x[..., 1::2])
    ra, rb = a * theta.cos() - b * theta.sin(), a * theta.sin() + b * theta.cos()
    return torch.cat((ra, rb), -1) if pairing == "half" else torch.stack((ra, rb), -1).flatten(-2)


def _rms(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    eps = getattr(norm, "variance_epsilon", None) or norm.eps
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm.weight


def _mla(x, q_layers, kv_a, kv_norm, kv_b, o, heads, d_nope, d_rope, d_v, pairing):
    """Latent attention by its formula: every head's query and key its no-RoPE part joined with its rotated part (the
    key's shared by every head), scores / √d_K, causal."""
    b, n, _ = x.shape
    q = q_layers(x).view(b, n, heads, d_nope + d_rope).transpose(1, 2)
    q = torch.cat([q[..., :d_nope], _rope(q[..., d_nope:], pairing)], -1)
    latent, k_pe = kv_a(x).split([kv_a.out_features - d_rope, d_rope], -1)
    kv = kv_b(_rms(latent, kv_norm)).view(b, n, heads, d_nope + d_v).transpose(1, 2)
    k = torch.cat([kv[..., :d_nope], _rope(k_pe[:, None], pairing).expand(-1, heads, -1, -1)], -1)
    out = F.scaled_dot_product_attention(q, k, kv[..., d_nope:], is_causal=True)
    return o(out.transpose(1, 2).flatten(2))


def _cached_v2(m, x):
    q_layers = lambda t: m.q_b_proj(_rms(m.q_a_proj(t), m.q_a_layernorm))  # noqa: E731
    return _mla(x, q_layers, m.kv_a_proj_with_mqa, m.kv_a_layernorm, m.kv_b_proj, m.o_proj, 4, 6, 4, 5, "interleaved")


def _inference(m, x):
    q_layers = lambda t: m.wq_b(_rms(m.wq_a(t), m.q_norm))  # noqa: E731
    return _mla(x, q_layers, m.wkv_a, m.kv_norm, m.wkv_b, m.wo, 4, 8, 4, 6, "interleaved")


def _half_split(m, x):
    return _mla(x, m.q_proj, m.kv_a_proj_with_mqa, m.kv_a_layernorm, m.kv_b_proj, m.o_proj, 3, 6, 4, 6, "half")


class Cache:
    """transformers' Cache as the code calls it: get_seq_length, update (the new keys joined after the held)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def update(self, k, v, layer_idx):
        self.k = k if self.k is None else torch.cat([self.k, k], -2)
        self.v = v if self.v is None else torch.cat([self.v, v], -2)
        return self.k, self.v


def _decoded(m, name: str, x: torch.Tensor, n0: int) -> torch.Tensor:
    """The last rows of x run as a decode step after its first n0, the cache in the style's own form."""
    if name == "CachedV2":
        cache = Cache()
        m(x[:, :n0], past_key_value=cache)
        return m(x[:, n0:], past_key_value=cache)
    if name == "InferenceCache":
        m(x[:, :n0], 0)
        return m(x[:, n0:], n0)
    cos, sin = styles.rope_tables(torch.arange(n0), 4, 10000.0)
    _, past = styles.latent_attention(m.q_proj(x[:, :n0]), m.kv_a_proj_with_mqa(x[:, :n0]), m.kv_a_layernorm,
                                      m.kv_b_proj, cos, sin, 3, 6, 4, 6, None)
    return m(x[:, n0:], past)


FORMULAS = {"CachedV2": _cached_v2, "InferenceCache": _inference, "HalfSplitMLA": _half_split}
WIDTH = {"CachedV2": 32, "InferenceCache": 32, "HalfSplitMLA": 24}
BUGS = {"CachedV2": ("no_rope", "no_offset"), "InferenceCache": ("no_rope", "no_offset"),
        "HalfSplitMLA": ("no_rope", "no_offset", "base")}


@pytest.mark.parametrize("name", list(FORMULAS))
def test_the_styles_are_latent_attention_and_the_plants_change_it(name):
    cls = getattr(styles, name)
    x = torch.randn(2, 9, WIDTH[name], dtype=torch.float64)
    m = cls().double().eval()
    want = FORMULAS[name](m, x)
    assert torch.allclose(m(x), want, atol=1e-5)
    assert torch.allclose(_decoded(m, name, x, 5), want[:, 5:], atol=1e-5)  # positions after the cache
    for bug in BUGS[name]:
        p = cls(bug=bug).double().eval()
        got = _decoded(p, name, x, 5) if bug == "no_offset" else p(x)
        ref = FORMULAS[name](p, x)
        assert (got - (ref[:, 5:] if bug == "no_offset" else ref)).abs().max() > 1e-2, bug


INTERLEAVED = ("--causal", "--rope", "--rope-pairing", "interleaved")
CORRECT = [("CachedV2", INTERLEAVED),
           ("CachedV2", (*INTERLEAVED, "--cache", "3")),
           ("InferenceCache", (*INTERLEAVED, "--cache", "3")),
           ("HalfSplitMLA", ("--causal", "--rope")),
           ("HalfSplitMLA", ("--causal", "--rope", "--cache", "3"))]


test_latent_attention_with_rope_passes = passing_test(STYLES, [(name, None, options) for name, options in CORRECT])


PLANTS = [("CachedV2", "no_rope", INTERLEAVED, "rope.not_applied"),
          ("CachedV2", "no_offset", (*INTERLEAVED, "--cache", "3"), "rope.positions"),
          ("InferenceCache", "no_rope", (*INTERLEAVED, "--cache", "3"), "rope.not_applied"),
          ("InferenceCache", "no_offset", (*INTERLEAVED, "--cache", "3"), "rope.positions"),
          ("HalfSplitMLA", "no_rope", ("--causal", "--rope"), "rope.not_applied"),
          ("HalfSplitMLA", "no_offset", ("--causal", "--rope", "--cache", "3"), "rope.positions"),
          ("HalfSplitMLA", "base", ("--causal", "--rope"), "rope.base")]


@pytest.mark.parametrize(("name", "bug", "options", "cause"), PLANTS, ids=case_ids(PLANTS))
def test_rope_mistakes_in_latent_attention_are_named(runner, name, bug, options, cause):
    found = assert_named(*run_case(runner, STYLES, name, f"bug={bug!r}", options), cause)
    assert found["reference"] in ("Q_pe_rot", "Q_full", "K_full", "K_cat")
