"""Round 31: a value norm read from the code stays in force whatever step diverges (issue #41). Gemma 3n's attention
norms q and k with gains and v without (scale 1); its values' norm was read as a convention only where the line-up
diverged at the values or after them, so where the keys' norm was left out (K_normed) or the norms ran after RoPE
(Q_normed) every catalog rerun ran with un-normed values, none gave the output back, and trace said "none of the usual
causes fits" (and an interleaved reading of RoPE's tables, which merely lost sight of K_normed, could then be kept).
A value norm held and never called was silent; it is now a note on a passing run (no experiment can name it: the
reference norms no values the code does not). Styles of our own (tests/trace_styles_round31_vnorm.py), the correct
one checked against F.scaled_dot_product_attention in float64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round31_vnorm.py")
styles = user_module(STYLES)
GEMMA_LIKE = ("--rope", "--causal", "--scale", "1", "--qk-norm")
VALUES_NOTE = "normalizes its values"


def _rms(t, gain=None, eps=1e-6):
    t = t * (t.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return t if gain is None else t * gain


def _rotated(t, base=10000.0):  # half-split RoPE at positions 0..n-1, float64
    n, d = t.shape[-2], t.shape[-1]
    turns = torch.outer(torch.arange(n, dtype=torch.float64), base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d))
    cos, sin = torch.cat((turns, turns), -1).cos(), torch.cat((turns, turns), -1).sin()
    return t * cos + torch.cat((-t[..., d // 2:], t[..., :d // 2]), -1) * sin


def _split(t, h):
    return t.view(t.shape[0], t.shape[1], h, -1).transpose(1, 2)


def test_the_style_is_normed_sdpa_at_scale_1():
    m = styles.NormedValueAttention().double()
    x = torch.randn(2, 6, 48, dtype=torch.float64)
    q = _rotated(_rms(_split(m.wq(x), 4), m.norm_q.g))
    k = _rotated(_rms(_split(m.wk(x), 2), m.norm_k.g))
    v = _rms(_split(m.wv(x), 2))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0, enable_gqa=True)
    want = m.wo(y.transpose(1, 2).reshape(2, 6, 48))
    torch.testing.assert_close(m(x), want, atol=1e-5, rtol=1e-5)  # its norms compute in float32
    for bug in ("k_unnormed", "rope_first", "v_idle"):
        planted = styles.NormedValueAttention(bug=bug).double()
        planted.load_state_dict(m.state_dict())
        assert (planted(x) - want).abs().max() > 1e-2, bug

    plain = styles.IdleGateAttention().double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    q, k, v = (_split(t.contiguous(), 4) for t in plain.qkv(x).chunk(3, -1))
    want = plain.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 32))
    torch.testing.assert_close(plain(x), want, atol=1e-10, rtol=1e-10)


def _said(out):
    return " ".join(" ".join(note.split()) for note in out["notes"])


def test_the_correct_style_passes_its_values_read_as_normed(runner):
    code, out = run_case(runner, STYLES, "NormedValueAttention", None, GEMMA_LIKE)
    assert_passes(code, out)
    assert VALUES_NOTE in _said(out) and "values RMS-normed" in out["reference"], out["notes"]


@pytest.mark.parametrize(("bug", "entry"), [("k_unnormed", "qknorm.missing"), ("rope_first", "qknorm.place")])
def test_a_qk_norm_mistake_is_named_with_the_values_still_normed(runner, bug, entry):
    code, out = run_case(runner, STYLES, "NormedValueAttention", f"bug='{bug}'", GEMMA_LIKE)
    assert_named(code, out, entry)
    assert VALUES_NOTE in _said(out) and "half-split" in out["reference"], (out["reference"], out["notes"])


def test_a_value_norm_never_called_is_said_not_named(runner):
    code, out = run_case(runner, STYLES, "NormedValueAttention", "bug='v_idle'", GEMMA_LIKE)
    assert_passes(code, out)
    said = _said(out)
    assert "your norm_v (HeadRMS" in said and "without weights" in said and "held but never called" in said, said
    assert VALUES_NOTE not in said


def test_a_value_norm_left_off_by_a_switch_is_only_a_note(runner):
    code, out = run_case(runner, STYLES, "IdleGateAttention")
    assert_passes(code, out)
    assert "your value_norm (RMSNorm" in _said(out), out["notes"]
    code, out = run_case(runner, STYLES, "IdleGateAttention", "norm_values=True")
    assert code == 0 and VALUES_NOTE in _said(out) and "never called" not in _said(out), out["notes"]
