"""Scores scaled twice where twice the scale is 1/d_head (head_dim 16) and the code's windows gather its scores, so
that no tensor of it holds the reference's scores whole (held-out round 53, Hiera: named scale.d_head). The two
readings give the same numbers; the code says which it wrote: two products with the reference's own scale before
the softmax (scaletrials.scales_twice) are scale.twice. The style is checked against F.scaled_dot_product_attention
in float64, unit by unit, first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from trace_styles_mask_units import MaskUnitAttention
from tracecases import assert_named, assert_passes, run_case

STYLES = str(Path(__file__).parent / "trace_styles_mask_units.py")


def test_each_unit_is_sdpa_over_its_pooled_queries_and_the_plant_changes_it():
    torch.manual_seed(0)
    m = MaskUnitAttention().double().eval()
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    units, per = 2, 8  # token t in unit t % 2
    q, k, v = m.qkv(x).view(2, 16, 3, 4, 16).permute(2, 0, 3, 1, 4)  # [B, H, 16, d]
    with torch.no_grad():
        out = torch.empty(2, 4, per // 4, units, 16, dtype=torch.float64)
        for u in range(units):
            tokens = torch.arange(u, 16, units)  # the unit's tokens, in order
            pooled = q[:, :, tokens].view(2, 4, 4, per // 4, 16).amax(dim=2)  # max over query_stride
            out[:, :, :, u] = F.scaled_dot_product_attention(pooled, k[:, :, tokens], v[:, :, tokens])
        want = m.proj(out.permute(0, 2, 3, 1, 4).reshape(2, -1, 64))
        assert (m(x) - want).abs().max() < 1e-10
        planted = MaskUnitAttention(bug="scale_twice").double().eval()
        planted.load_state_dict(m.state_dict())
        assert (planted(x) - m(x)).abs().max() > 1e-3


@pytest.mark.parametrize("bug", [None, "scale_twice"])
def test_scaled_twice_in_gathered_scores_is_scale_twice(runner, bug):
    found = run_case(runner, STYLES, "MaskUnitAttention", bug and f"bug='{bug}'", ("--nq", "16"))
    if bug is None:
        assert_passes(*found)
    else:
        assert_named(*found, "scale.twice")
