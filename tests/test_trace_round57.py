"""Held-out round 57 (UDOP, Informer, Emu3, OLMoE, ConvBERT, TimeSformer, XLM, Marian): findings in styles written
afresh.

TimeSformer's time attention sets its class token aside (`hidden_states[:, 1:]`), regroups the rest so that each
patch attends over its own frames, and norms the groups after regrouping them. Correct code got exit 1 ("none of
your tensors has Q_feat's shape") and every plant went unnamed: the regrouping reading (regroup.py) asked for a
tensor holding each of the input's rows, and for projections that read the groups as they are. Rows the groups
leave out are now read where they are the same tokens of every sequence, fewer than half (`Grouping.left`), what
the code returns without them is compared regrouped the same way, and a norm of the groups that the projections
read is their input side (`regroup.normed_after`), as a norm before the regrouping already was (SAM's). A norm of the
input that prenorm.py had made the input side before (the norm taken first) is regrouped too.

ConvBERT joins its attention heads with its convolution's along the heads' axis (torch.cat) and merges them with one
view after it; no tensor holds the attention heads merged alone, so the line-up ended at x_raw in a layout and the
after-x replay ran the code's own merge on the reference's output. A merge planted in the wrong order passed (exit
0). Where the ops after x only move and join values, what the module returns must hold x as a block of its features
(aftermerge._merged_out_of_order); a block that is x_raw merged in another order names the mistake."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from trace_styles_round57 import FramesOfEachPatch, HeadsBesideConv, NormedThenFramed
from tracecases import assert_named, assert_passes, run_case

STYLES = str(Path(__file__).parent / "trace_styles_round57.py")


def _reference(m, x: torch.Tensor) -> torch.Tensor:
    """Each patch's frames attending to each other, by F.scaled_dot_product_attention in float64: `[B, P·T, C]`."""
    b, n, c = x.shape
    h = m.attn.heads
    groups = F.layer_norm(x[:, 1:], (c,), m.norm.weight, m.norm.bias).reshape(-1, m.frames, c)
    q, k, v = (t.view(groups.shape[0], m.frames, h, c // h).transpose(1, 2)
               for t in m.attn.qkv(groups).chunk(3, dim=-1))
    out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(groups.shape)
    return m.attn.proj(out).reshape(b, n - 1, c)


@pytest.mark.parametrize(("style", "plant"), [(FramesOfEachPatch, "no_scale"), (NormedThenFramed, "kv_swapped")])
def test_the_styles_are_their_formula_and_the_plants_change_them(style, plant):
    torch.manual_seed(0)
    m = style().double().eval()
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    got = m(x)
    assert (got[:, -12:] - _reference(m, x)).abs().max() < 1e-10
    planted = style(bug=plant).double().eval()
    planted.load_state_dict(m.state_dict())
    assert (planted(x) - got).abs().max() > 1e-3


def test_frames_regrouped_without_the_class_token_and_normed_after_are_read(runner):
    assert_passes(*run_case(runner, STYLES, "FramesOfEachPatch", None, ("--nq", "13")))
    assert_named(*run_case(runner, STYLES, "FramesOfEachPatch", "bug='no_scale'", ("--nq", "13")), "scale.none")
    assert_named(*run_case(runner, STYLES, "FramesOfEachPatch", "bug='frames_softmax'", ("--nq", "13")),
                 "softmax.axis")


def test_a_norm_before_the_regrouping_with_the_class_token_passed_through_is_read(runner):
    code, out = run_case(runner, STYLES, "NormedThenFramed", None, ("--nq", "13"))
    assert_passes(code, out)
    assert any("set aside" in note for note in out["notes"]), out["notes"]
    assert_named(*run_case(runner, STYLES, "NormedThenFramed", "bug='kv_swapped'", ("--nq", "13")), "kv.swapped")


def test_heads_joined_with_other_features_before_their_merge_are_checked_in_order(runner):
    torch.manual_seed(0)
    m = HeadsBesideConv().double().eval()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    q, k, v = (p(x).view(2, 7, 4, 6).transpose(1, 2) for p in (m.query, m.key, m.value))
    heads = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 7, 24)
    got = m(x)
    assert (got[..., :24] - heads).abs().max() < 1e-10
    planted = HeadsBesideConv(bug="merge_permute").double().eval()
    planted.load_state_dict(m.state_dict())
    assert (planted(x)[..., :24] - heads).abs().max() > 1e-3
    assert_passes(*run_case(runner, STYLES, "HeadsBesideConv", None, ("--nq", "7")))
    assert_named(*run_case(runner, STYLES, "HeadsBesideConv", "bug='merge_permute'", ("--nq", "7")),
                 "heads.merge_wrong_permute")
