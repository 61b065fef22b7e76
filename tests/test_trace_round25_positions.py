"""`attnscope trace` on code that takes the tokens' positions as a required argument: where the code raises on what
trace first hands it (the input, a position embedding, positions [n]), it runs again given arange(n) [n], else one
row for each sequence [n_batch, n], kept with a note. Round 25's recurrentgemma Griffin block (`segment_pos`,
asserted [b, t] before any use) raised 'your code raised AssertionError' on correct code and on its 5 plants.
Styles of our own (tests/trace_styles_round25_positions.py), each checked against F.scaled_dot_product_attention in
float64 with RoPE written as complex products; each plant shown to change the output."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round25_positions.py")
styles = user_module(STYLES)
B, T = 2, 6


def _rope(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [b, h, t, d] turned at positions 0..t-1, base 10000, pairs (2i, 2i+1) or (i, i + d/2)."""
    t, d = x.shape[-2], x.shape[-1]
    angle = torch.arange(t, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    turn = torch.polar(torch.ones_like(angle), angle)
    if interleaved:
        return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous()) * turn).flatten(-2)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * turn
    return torch.cat((z.real, z.imag), -1)


def _heads(u: torch.Tensor, h: int) -> torch.Tensor:
    return u.view(B, T, h, -1).transpose(1, 2)  # [b, h, t, d]


def _attend(q, k, v, seen):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=seen).transpose(1, 2).reshape(B, T, -1)


def test_the_styles_are_attention():
    torch.manual_seed(0)
    x = torch.randn(B, T, 32, dtype=torch.float64)
    rows, line = torch.arange(T).repeat(B, 1), torch.arange(T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for name, bug in (("SegmentPositionsBlock", "window_off"), ("StepRotaryAttention", "scale_width"),
                      ("SeqPosAttention", "merge_view")):
        m, planted = (getattr(styles, name)(bug=b).double().eval() for b in (None, bug))
        if name == "SegmentPositionsBlock":
            q, k, v = (_heads(w(x), 4) for w in (m.proj_q, m.proj_k, m.proj_v))
            want = m.proj_final(_attend(_rope(q, False), _rope(k, False), v, causal & ~causal.tril(-m.window)))
            got, wrong = m(x, rows), planted(x, rows)
        elif name == "StepRotaryAttention":
            q, k, v = _heads(m.wq(x), 4), _heads(m.wk(x), 2), _heads(m.wv(x), 2)
            want = m.wo(_attend(_rope(q, True), _rope(k, True), v, causal))
            got, wrong = m(x, rows), planted(x, rows)
        else:
            q, k, v = (_heads(u, 4) for u in m.qkv(x).view(B, T, 3, -1).unbind(2))
            want = m.out(_attend(_rope(q, True), _rope(k, True), v, causal))
            got, wrong = m(x, line), planted(x, line)
        assert torch.allclose(got, want, atol=1e-6), (name, (got - want).abs().max())
        assert (wrong - want).abs().max() > 1e-3, name


CORRECT = [("SegmentPositionsBlock", None, ("--rope", "--window", "3")),
           ("StepRotaryAttention", None, ("--rope", "--causal")),
           ("SeqPosAttention", None, ("--rope", "--causal"))]

test_blocks_given_their_positions_pass = passing_test(STYLES, CORRECT)


PLANTS = [("SegmentPositionsBlock", "bug='window_off'", ("--rope", "--window", "3"), "mask.off_by_one"),
          ("StepRotaryAttention", "bug='scale_width'", ("--rope", "--causal"), "scale.d_model"),
          ("SeqPosAttention", "bug='merge_view'", ("--rope", "--causal"), "heads.merge_without_transpose")]

test_plants_in_blocks_given_their_positions_are_named = plants_test(STYLES, PLANTS)


def test_the_note_says_which_positions(runner):
    code, out = run_case(runner, STYLES, "SegmentPositionsBlock", None, ("--rope", "--window", "3"))
    assert code == 0
    assert any(note.startswith("segment_positions: your code raised") and "[n_batch, n_Q]" in note
               for note in out["notes"]), out["notes"]
    code, out = run_case(runner, STYLES, "SeqPosAttention", None, ("--rope", "--causal"))
    assert code == 0
    assert any(note.startswith("seq_pos: your code raised") and "torch.arange(n_Q)," in note
               for note in out["notes"]), out["notes"]
