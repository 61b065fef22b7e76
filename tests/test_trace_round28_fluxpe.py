"""`attnscope trace --rope --rope-pairing interleaved` on code whose forward takes RoPE's table as 2x2 rotation matrices
(round 28's Black Forest Labs Flux: `SelfAttention.forward(x, pe)`, `apply_rope`'s `pe[..., 0] * x_[..., 0] +
pe[..., 1] * x_[..., 1]`). trace fed `pe` the tokens' positions [n_batch, n_Q], on which the code ran only because
n_batch was 2, the pair's size, and said "RoPE is never applied to the queries" for the correct module and every
plant. Now a parameter whose values the code multiplies into its queries and keys as they are is read as RoPE's
table (paramuse.turns), never positions or an embedding, and given the reference's own angles in the form it runs on
(tableforms.MATRICES); a table in no form trace knows is one error line that says what was tried. Styles of our own
(tests/trace_styles_round28_fluxpe.py), each checked against F.scaled_dot_product_attention in float64 with RoPE
applied by the interleaved formula of transformers' apply_rotary_pos_emb (GPT-J's rotate_every_two)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from tracecases import passing_test, plants_test

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round28_fluxpe.py")
styles = user_module(STYLES)


def _interleaved(x: torch.Tensor) -> torch.Tensor:
    """x [b, h, n, d] turned as transformers' apply_rotary_pos_emb with GPT-J's rotate_every_two: pairs (2i, 2i+1),
    angle position · 10000^(-2i/d); cos and sin repeated for each coordinate of a pair."""
    n, d = x.shape[-2], x.shape[-1]
    angle = torch.arange(n, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1)
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin


def _rms(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * scale


def _flux_want(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    b, n, _ = x.shape
    q, k, v = m.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
    q, k = _interleaved(_rms(q, m.query_norm.scale)), _interleaved(_rms(k, m.key_norm.scale))
    return m.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, 32))


def _einsum_want(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    b, n, _ = x.shape
    q, k, v = (w(x).view(b, n, 4, 8).transpose(1, 2) for w in (m.wq, m.wk, m.wv))
    out = F.scaled_dot_product_attention(_interleaved(q), _interleaved(k), v, scale=1 / math.sqrt(8))
    return m.wo(out.transpose(1, 2).reshape(b, n, 32))


def test_the_styles_are_attention_with_interleaved_rope():
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    pe = styles.flux_table(2, 5, 8)  # [2, 1, 5, 4, 2, 2]
    rot = pe[:, 0].unsqueeze(2)  # [2, 5, 1, 4, 2, 2]
    for cls, table, want, bugs in ((styles.FluxAttention, pe, _flux_want, ("k_unrotated", "kv_swapped")),
                                   (styles.EinsumRotary, rot, _einsum_want, ("k_unrotated", "no_scale"))):
        m = cls().double().eval()
        expected = want(m, x)
        assert torch.allclose(m(x, table), expected, atol=1e-10), cls.__name__
        for bug in bugs:
            m.bug = bug  # the same weights, the plant's forward
            assert (m(x, table) - expected).abs().max() > 1e-3, (cls.__name__, bug)


def test_the_weights_are_trained():
    m = styles.FluxAttention()
    assert (m.query_norm.scale - 1).abs().min() > 1e-4 and (m.key_norm.scale - 1).abs().min() > 1e-4
    assert m.qkv.bias.abs().min() > 1e-4


ROPE = ("--rope", "--rope-pairing", "interleaved")
CORRECT = [("FluxAttention", None, (*ROPE, "--qk-norm", "head")), ("FluxAttention", None, ("--rope",)),
           ("EinsumRotary", None, ROPE)]

test_rotation_matrix_tables_pass = passing_test(STYLES, CORRECT)

PLANTS = [("FluxAttention", "bug='k_unrotated'", (*ROPE, "--qk-norm", "head"), "rope.not_applied"),
          ("FluxAttention", "bug='kv_swapped'", (*ROPE, "--qk-norm", "head"), "kv.swapped"),
          ("EinsumRotary", "bug='k_unrotated'", ROPE, "rope.not_applied"),
          ("EinsumRotary", "bug='no_scale'", ROPE, "scale.none")]

test_plants_beside_a_rotation_matrix_table_are_named = plants_test(STYLES, PLANTS)


def test_the_table_is_read_from_its_use_and_said(runner):
    result, out = trace(runner, f"{STYLES}:EinsumRotary", *ROPE)
    assert result.exit_code == 0, result.stdout + result.stderr
    said = " ".join(out["notes"])
    assert "2x2 rotation matrices" in said and "[n_batch, n_Q, 1, d_head/2, 2, 2]" in said
    assert "runs on RoPE's table" in said and "tokens' positions" not in said


def test_a_table_multiplied_in_without_rope_asks_for_it(runner):
    result, out = trace(runner, f"{STYLES}:FluxAttention")
    assert result.exit_code == 2 and out is None
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "pe: your code multiplies it into its queries or keys" in line
    assert "add --rope" in line and "Traceback" not in line


def test_a_table_in_no_known_form_is_one_line_saying_what_was_tried(runner):
    result, out = trace(runner, f"{STYLES}:ThreeTerms", "--rope")
    assert result.exit_code == 1 and out is None
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "runs on none of the forms trace knows" in line
    assert "2x2 rotation matrices" in line and "complex table" in line and "(cos, sin)" in line
    assert "Traceback" not in line
