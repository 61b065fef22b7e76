"""Held-out round 58 (SqueezeBERT, EfficientFormer, Idefics2, Decision Transformer, LayoutLMv3, BioGPT, CTRL,
Helium): findings in styles written afresh.

SqueezeBERT projects with grouped 1×1 convolutions (`nn.Conv1d(C, C, 1, groups=4)`), and trace refused it ("its
Linear layers are none"): a pointwise convolution was read as a projection only with one group. A grouped one
still reads each token alone, each group of output channels its own group of input channels: the Linear whose weight
is block-diagonal (pointwise.as_matrix), which the reference now holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from trace_styles_round58 import GroupedPointwise
from tracecases import assert_named, assert_passes, run_case, saved

from attnscope.usertrace.pointwise import as_matrix

STYLES = str(Path(__file__).parent / "trace_styles_round58.py")


def test_a_grouped_pointwise_kernel_is_the_block_diagonal_linear():
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(12, 8, 1, groups=4).double()
    x = torch.randn(2, 12, 5, dtype=torch.float64)
    linear = (as_matrix(conv.weight, 4) @ x) + conv.bias[:, None]
    assert (linear - conv(x)).abs().max() < 1e-12


def test_the_style_is_its_formula_and_the_plants_change_it():
    torch.manual_seed(0)
    m = GroupedPointwise().double().eval()
    x = torch.randn(2, 32, 9, dtype=torch.float64)
    pad = torch.zeros(2, 1, 1, 9, dtype=torch.float64)
    pad[1, ..., 6:] = -1e9  # finite: a softmax over the queries of a padded column stays a number
    got = m(x, pad)
    q, k, v = (p(x).view(2, 4, 8, 9).transpose(-1, -2) for p in (m.query, m.key, m.value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=pad)
    assert (got - out.transpose(-1, -2).reshape(2, 32, 9)).abs().max() < 1e-10
    for plant in ("scale_by_width", "query_softmax"):
        planted = GroupedPointwise(bug=plant).double().eval()
        planted.load_state_dict(m.state_dict())
        assert (planted(x, pad) - got).abs().max() > 1e-3


def test_grouped_pointwise_projections_are_read_as_linears(runner, tmp_path):
    keep = np.ones((2, 9), dtype=bool)
    keep[1, 6:] = False
    options = ("--layout", "col", "--batch", "2", "--nq", "9", "--mask", saved(tmp_path, "pad.npy", keep))
    assert_passes(*run_case(runner, STYLES, "GroupedPointwise", None, options))
    assert_named(*run_case(runner, STYLES, "GroupedPointwise", "bug='scale_by_width'", options), "scale.d_model")
    assert_named(*run_case(runner, STYLES, "GroupedPointwise", "bug='query_softmax'", options), "softmax.axis")
