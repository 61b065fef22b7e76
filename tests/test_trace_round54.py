"""Held-out round 54 (PVT, LongT5, BigBird, DeepSeek-V3, Phi-4-mini, SpeechT5, XLNet, Mixtral) and round 53's
leftovers: findings in styles written afresh.

Jais' ALiBi is symmetric, -m_h · |i - j|: under the causal mask the same as ALiBi's -m_h · (i - j), so correct code
passes. Added after the softmax, its cells above the diagonal no longer vanish, and alibi.after_softmax tried only
ALiBi's own form (and the one row a model hands in): the plant was left unnamed. The symmetric form is now tried
after the softmax too.

LeViT's learned bias per offset added after the softmax: its own bias was read, and its rerun named t5.after_softmax,
but only in the line-up that also reads its Hardswish after the merge (lineup._with_output_ops), which kept a line-up
only where it went further; a mistake named upstream now counts, as it does for an output term."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from trace_styles_round54 import OffsetBiasedAttention, SymmetricAlibi, _slopes
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


def test_the_offset_bias_style_is_its_formula_and_the_plant_changes_it():
    torch.manual_seed(0)
    m = OffsetBiasedAttention().double().eval()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    q, k, v = m.qkv(x).view(2, 9, 4, -1).split([8, 8, 16], dim=3)
    bias = m.attention_biases[:, m.attention_bias_idxs]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias)
    want = m.projection(F.hardswish(out.transpose(1, 2).reshape(2, 9, 64)))
    got = m(x)
    assert (got - want).abs().max() < 1e-10
    planted = OffsetBiasedAttention(bug="after_softmax").double().eval()
    planted.load_state_dict(m.state_dict())
    assert (planted(x) - got).abs().max() > 1e-3


def test_an_own_bias_added_after_the_softmax_is_named_beside_ops_on_the_merge(runner):
    assert_passes(*run_case(runner, STYLES, "OffsetBiasedAttention", None, ("--nq", "9")))
    assert_named(*run_case(runner, STYLES, "OffsetBiasedAttention", "bug='after_softmax'", ("--nq", "9")),
                 "t5.after_softmax")
