"""Queries and keys that join a positional part of their own to each head (Conditional DETR's and DAB-DETR's decoder
cross-attention, `cat([q_content, q_pos], dim=-1)` per head): their scores contract over twice the content's head
width, `q · kᵀ + q_pos · k_posᵀ`, scaled by 1/√(2·d_head). trace called such correct code buggy ("none of the usual
causes fits" at the scores); it now reads the joined parts off the scores' product (usertrace/headparts.py), adds
their product to the reference's scores before the scale and scales by 1/√D. The style is checked first against
F.scaled_dot_product_attention in float64 on the joined tensors (its default scale is 1/√D)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from trace_styles_round51_headparts import JoinedPositionCrossAttention
from tracecases import assert_named, assert_passes, run_case

STYLES = str(Path(__file__).parent / "trace_styles_round51_headparts.py")
TARGET = "JoinedPositionCrossAttention"
B, N_Q, N_K = 2, 5, 7


def _reference(m: JoinedPositionCrossAttention, tgt, memory, query_pos, memory_pos) -> torch.Tensor:
    def heads(x):
        return x.view(B, x.shape[1], m.h, m.d_head).transpose(1, 2)

    def joined(content, pos):
        return torch.cat((heads(pos), heads(content)) if m.pos_first else (heads(content), heads(pos)), dim=-1)

    q = joined(m.q_content(tgt), m.q_pos(query_pos))
    k = joined(m.k_content(memory), m.k_pos(memory_pos))
    out = F.scaled_dot_product_attention(q, k, heads(m.v_proj(memory)))  # scale 1/√(2·d_head): q's own width
    return m.out_proj(out.transpose(1, 2).reshape(B, N_Q, -1))


@pytest.mark.parametrize("pos_first", [False, True])
def test_the_style_is_its_formula_and_the_plants_change_it(pos_first):
    torch.manual_seed(0)
    m = JoinedPositionCrossAttention(pos_first=pos_first).double().eval()
    inputs = [torch.randn(B, n, 32, dtype=torch.float64) for n in (N_Q, N_K, N_Q, N_K)]
    got = m(*inputs)
    assert (got - _reference(m, *inputs)).abs().max() < 1e-10
    for bug in ("scale_head_dim", "softmax_queries", "merge_no_transpose"):
        planted = JoinedPositionCrossAttention(pos_first=pos_first, bug=bug).double().eval()
        planted.load_state_dict(m.state_dict())
        assert (planted(*inputs) - got).abs().max() > 1e-3


@pytest.mark.parametrize("init", ["pos_first=False", "pos_first=True"])
def test_positional_parts_joined_per_head_line_up(runner, init):
    code, out = run_case(runner, STYLES, TARGET, init, ("--nk", str(N_K)))
    assert_passes(code, out)
    said = " ".join(" ".join(out["notes"]).split())
    assert "your queries and keys each join a part of their own (8 wide)" in said, said
    assert "the reference adds the product of those parts to its scores before the scale" in said


@pytest.mark.parametrize(("bug", "entry"), [("softmax_queries", "softmax.axis"),
                                            ("merge_no_transpose", "heads.merge_without_transpose"),
                                            ("scale_head_dim", "scale.none")])
def test_mistakes_beside_the_joined_parts_are_named(runner, bug, entry):
    found = assert_named(*run_case(runner, STYLES, TARGET, f"bug={bug!r}", ("--nk", str(N_K))), entry)
    if bug == "scale_head_dim":
        assert "multiplied by 1/√16: the width your scores contract over" in " ".join(found["diagnosis"].split())
