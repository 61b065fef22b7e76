"""`attnscope trace` on attention that takes RoPE's tables half-split, `cat((freqs, freqs))`, as its model's rotary
module makes them, and lays them out interleaved itself before it turns its pairs (2i, 2i + 1): transformers' GLM,
GLM-4 and Helium (`cos[..., : cos.shape[-1] // 2].repeat_interleave(2)`), at the share of each head its config says
or the whole head. trace hands the tables half-split, reads the interleaved pairing as the code's convention (a note,
exit 0; usertrace/tablelayouts.converted) and still names the RoPE mistakes by experiment. Each style is first
checked in float64 against a formula (complex rotations of its pairs, then F.scaled_dot_product_attention), and the
formula against transformers' own GLM apply_rotary_pos_emb."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _trace_ref import sdpa
from test_trace_command import user_module
from trace_round14_helpers import planted
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round30_glmrope.py")
styles = user_module(STYLES)
B, N, D, H, KV = 2, 6, 64, 4, 2


def _angles(rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    """position · inv_freq, [N, rotary_dim / 2], the frequencies over rotary_dim, float64."""
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    return torch.arange(N, dtype=torch.float64)[:, None] * inv


def _cat(rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables as a LLaMA-style rotary module makes them, cat((freqs, freqs)): (cos, sin) [N, rotary_dim]."""
    a = torch.cat([_angles(rotary_dim)] * 2, -1)
    return a.cos(), a.sin()


def _turned(x: torch.Tensor, heads: int, rotary_dim: int) -> torch.Tensor:
    """x [B, N, heads·d]: the first rotary_dim of each head turned, pair (2i, 2i + 1) by angle i, as complex numbers;
    the rest as it is."""
    x = x.unflatten(-1, (heads, -1))
    part, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    z = torch.view_as_complex(part.unflatten(-1, (-1, 2)).contiguous())
    z = z * torch.polar(torch.ones_like(_angles(rotary_dim)), _angles(rotary_dim))[None, :, None]
    return torch.cat([torch.view_as_real(z).flatten(-2), rest], dim=-1).flatten(-2)


def _want_glm(m, x):
    q, k, v = m.q_proj(x), m.k_proj(x), m.v_proj(x)
    q, k = _turned(q, H, 8), _turned(k, KV, 8)
    k, v = (t.unflatten(-1, (KV, -1)).repeat_interleave(H // KV, 2).flatten(-2) for t in (k, v))
    return m.o_proj(sdpa(q, k, v, H, causal=True))


def _want_helium(m, x):
    q, k, v = m.qkv(x).chunk(3, dim=-1)
    return m.proj(sdpa(_turned(q, H, 16), _turned(k, H, 16), v, H, causal=True))


def _want_einsum(m, x):
    q, k, v = m.wq(x), m.wk(x), m.wv(x)
    return m.wo(sdpa(_turned(q, H, 8), _turned(k, H, 8), v, H, causal=True))


def test_the_formula_is_transformers_own_glm_rotation():
    """The float64 formula's turn is what transformers' GLM apply_rotary_pos_emb makes of cat((freqs, freqs))
    tables 8 wide, over the first 8 of each head's 16 coordinates."""
    from transformers.models.glm.modeling_glm import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(30)
    q, k = (torch.randn(B, heads, N, 16, generator=g, dtype=torch.float64) for heads in (H, KV))
    cos, sin = (t.expand(B, -1, -1) for t in _cat(8))
    q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin)
    for mine, x, heads in ((q_embed, q, H), (k_embed, k, KV)):
        flat = x.transpose(1, 2).flatten(-2)  # [B, N, heads·16]
        assert torch.allclose(mine.transpose(1, 2).flatten(-2), _turned(flat, heads, 8), atol=1e-12)


def test_the_styles_are_rope_then_sdpa_and_the_plants_change_them():
    x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(301), dtype=torch.float64)
    full, share = (tuple(t.expand(B, -1, -1) for t in _cat(r)) for r in (16, 8))
    cases = [(styles.GlmLikePartial, _want_glm, (share,), ("halves",)),
             (styles.HeliumLikeFull, _want_helium, (full,), ("share",)),
             (styles.EinsumApart, _want_einsum, _cat(8), ("unconverted",))]
    with torch.no_grad():
        for cls, want_of, tables, bugs in cases:
            m = cls().double().eval()
            want = want_of(m, x)
            assert torch.allclose(m(x, *tables), want, atol=1e-10), cls.__name__
            for bug in bugs:
                # (`share` leaves the slowest pairs unturned: a small change at N = 6 tokens, far above float64's)
                assert (planted(cls, m, bug, x, *tables) - want).abs().max() > 1e-3, (cls.__name__, bug)


OPTIONS = ("--rope", "--causal")
CORRECT = [("GlmLikePartial", None, OPTIONS), ("HeliumLikeFull", None, OPTIONS), ("EinsumApart", None, OPTIONS),
           ("GlmLikePartial", None, (*OPTIONS, "--rope-pairing", "interleaved"))]

test_correct_styles_pass = passing_test(STYLES, CORRECT)

PLANTED = [("GlmLikePartial", "bug='halves'", OPTIONS, "rope.pairing"),
           ("HeliumLikeFull", "bug='share'", OPTIONS, "rope.fraction"),
           ("EinsumApart", "bug='unconverted'", OPTIONS, "rope.pairing"),
           # asked for half-split, the code's interleaved turn is the mistake
           ("GlmLikePartial", None, (*OPTIONS, "--rope-pairing", "half-split"), "rope.pairing")]

test_planted_bugs_are_named_by_experiment = plants_test(STYLES, PLANTED)


def test_the_note_says_the_code_lays_the_tables_out_itself(runner):
    code, out = run_case(runner, STYLES, "GlmLikePartial", None, OPTIONS)
    assert code == 0
    said = " ".join(out["notes"])
    assert "half-split, cat((freqs, freqs)), 8 wide, which your code lays out interleaved itself" in said, said
    assert "over the first 8 of each head's 16 coordinates" in said, said


@pytest.mark.parametrize(("model", "target", "init"), [
    ("glm", "GlmAttention",
     "config=GlmConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16), layer_idx=0"),
    ("helium", "HeliumAttention",
     "config=HeliumConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16), layer_idx=0")])
def test_transformers_own_classes_pass(runner, model, target, init):
    """GLM's tables half the head wide (its partial_rotary_factor 0.5), Helium's the whole head: transformers' own
    code, traced in its own file (imported as a module of its package)."""
    import transformers

    path = Path(transformers.__file__).parent / "models" / model / f"modeling_{model}.py"
    code, out = run_case(runner, str(path), target, init, OPTIONS)
    assert code == 0 and out["first_divergence"] is None, out["first_divergence"]
    assert "which your code lays out interleaved itself" in " ".join(out["notes"]), out["notes"]
