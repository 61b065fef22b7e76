"""`attnscope trace` on lit-gpt's 2023 CausalSelfAttention, which expands k and v to the query heads BEFORE it applies
RoPE: RoPE turns every head alike, so the numbers are those of rotating first; a convention (a note, exit 0), never
"RoPE applied after the head repeat" as a mistake. Its planted mistakes are still named by experiment. The style is
first checked in float64 against a formula of its own: per-group rows, complex rotations of the half-split pairs of
the first rope_n_elem coordinates, transformers' repeat_kv, then F.scaled_dot_product_attention."""

from __future__ import annotations

from pathlib import Path

import torch
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case
from transformers.models.llama.modeling_llama import repeat_kv

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round30_litgpt.py")
styles = user_module(STYLES)
B, N, D, H, G, R = 2, 6, 64, 4, 2, 8  # batch, tokens, width, query heads, query groups, rope_n_elem


def _rotated(x: torch.Tensor) -> torch.Tensor:
    """x [B, heads, N, 16]: coordinates (i, i + R/2) of the first R turned by position · 10000^(-2i/R)."""
    inv = 1.0 / 10000 ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    angle = torch.arange(N, dtype=torch.float64)[:, None] * inv  # [N, R/2]
    z = torch.complex(x[..., : R // 2], x[..., R // 2: R]) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag, x[..., R:]], dim=-1)


def _want(m, x):
    w = m.attn(x).unflatten(-1, (G, H // G + 2, 16))  # [B, N, groups, q_per_kv + 2, d]
    q = w[..., : H // G, :].flatten(2, 3).transpose(1, 2)  # [B, H, N, d], head g·q_per_kv + i
    k, v = (w[..., i, :].transpose(1, 2) for i in (H // G, H // G + 1))  # [B, G, N, d]
    q, k = _rotated(q), _rotated(k)
    out = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, H // G), repeat_kv(v, H // G),
                                                           is_causal=True)
    return m.proj(out.transpose(1, 2).flatten(-2))


def test_the_style_is_rope_then_sdpa_and_the_plants_change_it():
    x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(302), dtype=torch.float64)
    with torch.no_grad():
        m = styles.CausalSelfAttention().double().eval()
        want = _want(m, x)
        assert torch.allclose(m(x), want, atol=1e-10)
        for cls in (styles.NoScale, styles.ValuesRotated):
            planted = cls().double().eval()
            planted.load_state_dict(m.state_dict())
            assert (planted(x) - want).abs().max() > 1e-3, cls.__name__


OPTIONS = ("--rope", "--causal")
test_correct_style_passes = passing_test(STYLES, [("CausalSelfAttention", None, OPTIONS)])
test_planted_bugs_are_named_by_experiment = plants_test(STYLES, [("NoScale", None, OPTIONS, "scale.none"),
                                                                 ("ValuesRotated", None, OPTIONS, "rope.on_values")])


def test_the_note_says_rope_after_the_repeat_is_a_convention(runner):
    code, out = run_case(runner, STYLES, "CausalSelfAttention", None, OPTIONS)
    assert code == 0
    said = " ".join(out["notes"])
    assert "RoPE after the head repeat" in said and "a convention, not a mistake" in said, said
