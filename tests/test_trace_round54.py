"""Held-out round 54 (PVT, LongT5, BigBird, DeepSeek-V3, Phi-4-mini, SpeechT5, XLNet, Mixtral) and round 53's
leftovers: findings in styles written afresh.

Jais' ALiBi is symmetric, -m_h · |i - j|: under the causal mask the same as ALiBi's -m_h · (i - j), so correct code
passes. Added after the softmax, its cells above the diagonal no longer vanish, and alibi.after_softmax tried only
ALiBi's own form (and the one row a model hands in): the plant was left unnamed. The symmetric form is now tried
after the softmax too."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from trace_styles_round54 import SymmetricAlibi, _slopes
from tracecases import assert_named, assert_passes, run_case

STYLES = str(Path(__file__).parent / "trace_styles_round54.py")
ALIBI = ("--causal", "--alibi", "--scale", "0.125", "--nq", "9")


def test_the_symmetric_alibi_is_alibi_under_the_causal_mask_and_the_plant_changes_it():
    torch.manual_seed(0)
    m = SymmetricAlibi().double().eval()
    B, T = 2, 9
    x = torch.randn(B, T, 32, dtype=torch.float64)
    q, k, v = (t.view(B, T, 4, 8).transpose(1, 2) for t in m.c_attn(x).split(32, dim=2))
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    bias = -_slopes(4).double()[:, None, None] * (i - j)  # ALiBi's -m_h · (i - j)
    bias = bias.masked_fill(j > i, float("-inf"))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1 / 8).transpose(1, 2).reshape(B, T, 32)
    got = m(x)
    assert (got - m.c_proj(want)).abs().max() < 1e-10
    planted = SymmetricAlibi(bug="after_softmax").double().eval()
    planted.load_state_dict(m.state_dict())
    assert (planted(x) - got).abs().max() > 1e-3


def test_a_symmetric_alibi_added_after_the_softmax_is_named(runner):
    assert_passes(*run_case(runner, STYLES, "SymmetricAlibi", None, ALIBI))
    found = assert_named(*run_case(runner, STYLES, "SymmetricAlibi", "bug='after_softmax'", ALIBI),
                         "alibi.after_softmax")
    assert "symmetric" in found["diagnosis"], found
