"""`attnscope trace` on ALiBi written as −m_h·|j − i| beside a causal mask (round 22's Jais) where a mask plant makes
two deviations at once: the mask's mistake is named by experiment with the symmetric bias kept as the code's
convention (usertrace/pairs.py; before it, the message said no one catalog mistake gives the code back), never that
the code adds no position bias (it adds one). Code that adds none is still told so.
Styles of our own (tests/trace_styles_round22_alibi.py), checked against F.scaled_dot_product_attention in float64
with ALiBi's bias as its float mask; each plant shown to change the output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round22_alibi.py")
styles = user_module(STYLES)
OPTIONS = ("--causal", "--alibi")


def test_the_style_is_sdpa_with_alibi():
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    m = styles.AbsAlibi().double()
    q, k, v = m.qkv(x).view(2, 6, 3, 4, 8).permute(2, 0, 3, 1, 4)
    pos = torch.arange(6, dtype=torch.float64)
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / 4) for i in range(4)], dtype=torch.float64)
    bias = slopes[:, None, None] * (pos[None, :] - pos[:, None])  # ALiBi: m_h · (j − i)
    bias = bias.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    want = m.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(2, 6, 32))
    assert torch.allclose(m(x), want, atol=1e-10)
    for bug in ("band_off", "mask_after_softmax", "no_bias"):
        assert (styles.AbsAlibi(bug=bug).double()(x) - want).abs().max() > 1e-3, bug


def test_the_style_passes(runner):
    assert_passes(*run_case(runner, STYLES, "AbsAlibi", None, OPTIONS))


@pytest.mark.parametrize(("bug", "entry"), [("band_off", "mask.off_by_one"),
                                           ("mask_after_softmax", "mask.after_softmax")])
def test_two_deviations_are_said_true(runner, bug, entry):
    """Since usertrace/pairs.py, the two deviations are named by experiment: the mask's mistake, with the code's
    symmetric bias kept as its convention (round25_pairs holds more styles)."""
    code, out = run_case(runner, STYLES, "AbsAlibi", f"bug={bug!r}", OPTIONS)
    found = assert_named(code, out, entry)
    assert "adds no position bias" not in found["diagnosis"], found
    assert "alibi.query_positions kept" in found["evidence"], found


def test_no_bias_at_all_is_said_missing(runner):
    code, out = run_case(runner, STYLES, "AbsAlibi", "bug='no_bias'", OPTIONS)
    assert code == 1 and "adds no position bias" in out["first_divergence"]["diagnosis"], out["first_divergence"]
