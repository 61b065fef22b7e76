"""`attnscope trace` on attention that takes RoPE's tables as a forward argument (`position_embeddings`) in the
forms transformers' own models hand them: sin first (GPT-J, CodeGen), half-width tables the code expands itself,
interleaved tables (Cohere), half-split tables over a share of each head (StableLM). trace hands the pair in the
form the code runs on and lines up with (usertrace/tablelayouts.py, runs/trace_tables.py), says which in a note,
and still names mistakes by experiment. Each style is first checked against a float64 formula: RoPE as the style
defines it, complex rotations of its pairs, then F.scaled_dot_product_attention."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _trace_ref import sdpa
from test_trace_command import user_module
from trace_round14_helpers import planted
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round29_ropetables.py")
styles = user_module(STYLES)
B, N, D, H = 2, 6, 64, 4


def _angles(rotary_dim: int) -> torch.Tensor:
    """position · inv_freq, [N, rotary_dim / 2], base 10000, float64."""
    inv = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    return torch.arange(N, dtype=torch.float64)[:, None] * inv


def _turned(x: torch.Tensor, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """x [B, N, H·d]: the first rotary_dim of each head turned, pair i by angle i, the pairs (2i, 2i + 1) or
    (i, i + rotary_dim / 2), as complex numbers; the rest as they are."""
    x = x.unflatten(-1, (H, -1))
    part, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        z = torch.view_as_complex(part.unflatten(-1, (-1, 2)).contiguous())
    else:
        z = torch.complex(part[..., : rotary_dim // 2], part[..., rotary_dim // 2:])
    z = z * torch.polar(torch.ones_like(_angles(rotary_dim)), _angles(rotary_dim))[None, :, None]
    part = torch.view_as_real(z).flatten(-2) if interleaved else torch.cat([z.real, z.imag], dim=-1)
    return torch.cat([part, rest], dim=-1).flatten(-2)


def _want(m, x, rotary_dim, interleaved):
    q, k, v = m.q_proj(x), m.k_proj(x), m.v_proj(x)
    q, k = _turned(q, rotary_dim, interleaved), _turned(k, rotary_dim, interleaved)
    return m.out_proj(sdpa(q, k, v, H, causal=True))


def _tables(kind: str):
    """The pair as each style's model hands it: GPT-J's (sin, cos) [B, N, 4]; Cohere's interleaved (cos, sin)
    [B, N, 16]; LLaMA's half-split (cos, sin) [B, N, 8]."""
    if kind == "sin first":
        a = _angles(8)
        return a.sin().expand(B, -1, -1), a.cos().expand(B, -1, -1)
    a = _angles(16).repeat_interleave(2, -1) if kind == "interleaved" else torch.cat([_angles(8)] * 2, -1)
    return a.cos().expand(B, -1, -1), a.sin().expand(B, -1, -1)


CASES = [(styles.SinFirstPartial, "sin first", 8, True), (styles.InterleavedFull, "interleaved", 16, True),
         (styles.CatPartial, "cat", 8, False)]


def test_the_styles_are_rope_then_sdpa_and_the_plants_change_them():
    x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(29), dtype=torch.float64)
    with torch.no_grad():
        for cls, kind, rotary_dim, interleaved in CASES:
            m = cls().double().eval()
            want = _want(m, x, rotary_dim, interleaved)
            assert torch.allclose(m(x, _tables(kind)), want, atol=1e-10), cls.__name__
            for bug in ("rope_on_values", "no_scale") + (("rotate_half",) if kind == "sin first" else ()):
                wrong = planted(cls, m, bug, x, _tables(kind))
                assert (wrong - want).abs().max() > 1e-2, (cls.__name__, bug)


OPTIONS = ("--rope", "--causal")
CORRECT = [("SinFirstPartial", None, OPTIONS), ("InterleavedFull", None, OPTIONS), ("CatPartial", None, OPTIONS)]

test_correct_styles_pass = passing_test(STYLES, CORRECT)

PLANTED = [("SinFirstPartial", "bug='rotate_half'", OPTIONS, "rope.pairing"),
           ("InterleavedFull", "bug='rope_on_values'", OPTIONS, "rope.on_values"),
           ("CatPartial", "bug='no_scale'", OPTIONS, "scale.none")]

test_planted_bugs_are_named_by_experiment = plants_test(STYLES, PLANTED)


def test_the_note_says_the_form_of_the_tables(runner):
    code, out = run_case(runner, STYLES, "SinFirstPartial", None, OPTIONS)
    assert code == 0
    said = " ".join(out["notes"])
    assert "given as (sin, cos), sin first, one angle a pair, 4 wide" in said, out["notes"]
    assert "over the first 8 of each head's 16 coordinates" in said, out["notes"]


@pytest.mark.parametrize(("model", "target", "init"), [
    ("gptj", "GPTJAttention", "config=GPTJConfig(n_embd=64, n_head=4, rotary_dim=8), layer_idx=0"),
    ("cohere", "CohereAttention",
     "config=CohereConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, use_qk_norm=True), "
     "layer_idx=0")])
def test_transformers_own_classes_pass(runner, model, target, init):
    """GPT-J's sin-first half-width tables over its rotary_dim, Cohere's interleaved ones: transformers' own code,
    traced in its own file (imported as a module of its package)."""
    import transformers

    path = Path(transformers.__file__).parent / "models" / model / f"modeling_{model}.py"
    code, out = run_case(runner, str(path), target, init, OPTIONS)
    assert code == 0 and out["first_divergence"] is None, out["first_divergence"]
    said = " ".join(out["notes"])
    assert ("sin first" if model == "gptj" else "interleaved, repeat_interleave(freqs, 2)") in said, out["notes"]
