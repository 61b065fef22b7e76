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
from trace_styles_round58 import GroupedPointwise, MaskedOnes, PBRelax, PerHeadWidths
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


def _efficient(bug: str = "") -> torch.nn.Module:
    torch.manual_seed(0)
    m = PerHeadWidths(bug=bug)
    with torch.no_grad():  # off their init values, the table too (a trained one is not 0)
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m.double().eval()  # eval() caches the table's lookup, as the module does


def test_the_per_head_widths_style_is_its_formula_and_the_plants_change_it():
    m = _efficient()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    rows = m.qkv(x).view(2, 9, 4, 16)  # per head: 4 of q, 4 of k, 8 of v
    q, k, v = (rows[..., a:b].transpose(1, 2) for a, b in ((0, 4), (4, 8), (8, 16)))
    cells = [(i, j) for i in range(3) for j in range(3)]
    offsets = sorted({(abs(a[0] - b[0]), abs(a[1] - b[1])) for a in cells for b in cells})
    bias = torch.stack([torch.stack([m.table[:, offsets.index((abs(a[0] - b[0]), abs(a[1] - b[1])))]
                                     for b in cells], -1) for a in cells], -2)  # [heads, 9, 9], written out
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.detach())
    with torch.no_grad():
        assert (m(x) - m.proj(out.transpose(1, 2).reshape(2, 9, 32))).abs().max() < 1e-10
        for plant in ("bias_after_softmax", "split_without_permute"):
            planted = _efficient(plant)
            assert (planted(x) - m(x)).abs().max() > 1e-3


def test_heads_of_their_own_widths_cut_from_one_fused_projection(runner):
    """EfficientFormer (round 58: correct code refused, 'qkv[48:104] writes 56 features, not a whole number of
    heads'): the fused output viewed per head and split [key_dim, key_dim, value_dim] is read per head (the split of
    the view, fused.recorded_splits), d_head from the code's queries where d_feat / n_head says otherwise (solve_rows);
    its zero table is filled (zerotables.py) and its cached lookup read as its own bias (ownbias.cached)."""
    code, out = run_case(runner, STYLES, "PerHeadWidths", None, ("--nq", "9"))
    assert_passes(code, out)
    assert out["params"]["sizes"]["d_head"] == 4, out["params"]["sizes"]
    assert any(note.startswith("table: your module's __init__ leaves it all 0") for note in out["notes"]), out["notes"]
    notes = out["notes"]
    assert any("position bias of its own" in note and "of table's values" in note for note in notes), notes
    assert_named(*run_case(runner, STYLES, "PerHeadWidths", "bug='bias_after_softmax'", ("--nq", "9")),
                 "t5.after_softmax")
    assert_named(*run_case(runner, STYLES, "PerHeadWidths", "bug='split_without_permute'", ("--nq", "9")),
                 "heads.split_without_permute")


def test_a_mask_multiplied_as_one_minus_it_is_named(runner):
    """CTRL's mask is 1 where a key is masked; the plant `scores * (1 - mask)` (round 58 #31) was read as a mask of
    1 = may attend turned into numbers, so the scores multiplied by the masked cells read as 'the mask is not
    applied'. What multiplies the scores keeps where it is 1: the mask's 1 is masked out (masking.detect), and the
    multiplied mask is named by experiment."""
    torch.manual_seed(0)
    m = MaskedOnes().double().eval()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    masked = torch.ones(6, 6, dtype=torch.float64).triu(1)
    q, k, v = (w(x).view(2, 6, 4, 8).transpose(1, 2) for w in (m.Wq, m.Wk, m.Wv))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.no_grad():
        assert (m(x, masked) - m.dense(out.transpose(1, 2).reshape(2, 6, 32))).abs().max() < 1e-6  # e^-1e4 = 0
        planted = MaskedOnes(bug="multiplied").double().eval()
        planted.load_state_dict(m.state_dict())
        assert (planted(x, masked) - m(x, masked)).abs().max() > 1e-3
    assert_passes(*run_case(runner, STYLES, "MaskedOnes", None, ("--causal", "--nq", "6")))
    assert_named(*run_case(runner, STYLES, "MaskedOnes", "bug='multiplied'", ("--causal", "--nq", "6")),
                 "mask.multiplied")


def test_a_softmax_over_the_queries_after_the_max_taken_out_is_named(runner):
    """LayoutLMv3's CogView softmax over the queries (round 58 #23): each query's max taken out by hand changes a
    softmax over the queries, so the rerun on the reference's scores could not give it back; the code's own softmax
    input, the reference's scores up to a constant per query row, is softmaxed over the other axis
    (scaletrials.code_shifted)."""
    torch.manual_seed(0)
    m = PBRelax().double().eval()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    q, k, v = (f(x).view(2, 7, 4, 8).transpose(1, 2) for f in (m.query, m.key, m.value))
    with torch.no_grad():
        expected = m.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 7, 32))
        assert (m(x) - expected).abs().max() < 1e-10
        planted = PBRelax(bug="softmax_queries").double().eval()
        planted.load_state_dict(m.state_dict())
        assert (planted(x) - m(x)).abs().max() > 1e-3
    assert_passes(*run_case(runner, STYLES, "PBRelax", None, ("--nq", "7")))
    assert_named(*run_case(runner, STYLES, "PBRelax", "bug='softmax_queries'", ("--nq", "7")), "softmax.axis")
