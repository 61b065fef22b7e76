"""Held-out round 60 (Florence-2, JinaBERT, NeoBERT, DINOv3, RemBERT, PatchTST, Nemotron-H, HuBERT): findings in
styles written afresh.

Window attention that takes an image `[b, h, w, c]`, cuts it into windows itself and returns the image folded back
(timm's Swin block, Florence-2's DaViT without its last `.view(b, h·w, c)`) lined up to the windows' output and then
diverged at x: the return was regrouped only where laid out as rows `[b, n, ..]`, so the image was compared in raster
order with the reference's output in window order (a false alarm, exit 1). A return laid out as the image handed in
is read as its rows first (regroup._returned_grouped)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from trace_styles_round60 import ApartHeadDim, ImageWindows, SymmetricAlibi, alibi_slopes
from tracecases import assert_named, assert_passes, run_case, saved

STYLES = str(Path(__file__).parent / "trace_styles_round60.py")


def test_the_image_windows_style_is_attention_within_each_window():
    torch.manual_seed(0)
    m = ImageWindows().double().eval()
    x = torch.randn(2, 4, 4, 32, dtype=torch.float64)
    tokens = x.reshape(2, 16, 32)
    row, col = torch.arange(16) // 4, torch.arange(16) % 4
    same = (row[:, None] // 2 == row[None, :] // 2) & (col[:, None] // 2 == col[None, :] // 2)  # one window
    q, k, v = m.qkv(tokens).view(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=same)
    with torch.no_grad():
        expected = m.proj(out.transpose(1, 2).reshape(2, 16, 32)).reshape(2, 4, 4, 32)
        assert (m(x) - expected).abs().max() < 1e-10
        planted = ImageWindows(bug="scale_twice").double().eval()
        planted.load_state_dict(m.state_dict())
        assert (planted(x) - m(x)).abs().max() > 1e-3


def test_windows_folded_back_into_an_image_pass(runner):
    assert_passes(*run_case(runner, STYLES, "ImageWindows", None, ("--nq", "16")))
    assert_named(*run_case(runner, STYLES, "ImageWindows", "bug='scale_twice'", ("--nq", "16")), "scale.d_head")


def test_symmetric_alibi_given_as_a_file_runs_alibis_trials(runner, tmp_path):
    """JinaBERT's bidirectional ALiBi, −m_h · |i − j|, for which --alibi has no word, told by a --position-bias file
    (round 60 #9: wrong slopes were 'none of the usual causes fits'): a file that is ALiBi with its own slopes, in
    either form, gets ALiBi's trials (biastrials._filed_alibi)."""
    slopes = torch.tensor(alibi_slopes(4), dtype=torch.float64)
    distance = (torch.arange(7)[:, None] - torch.arange(7)[None, :]).abs()
    bias = -slopes[:, None, None] * distance  # [heads, n, n], written out
    torch.manual_seed(0)
    m = SymmetricAlibi().double().eval()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    q, k, v = m.Wqkv(x).view(2, 7, 3, 4, 8).permute(2, 0, 3, 1, 4)
    with torch.no_grad():
        expected = m.out(F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(2, 7, 32))
        assert (m(x) - expected).abs().max() < 1e-10
        for plant in ("slopes_from_zero", "sign"):
            planted = SymmetricAlibi(bug=plant).double().eval()
            planted.load_state_dict(m.state_dict())
            assert (planted(x) - m(x)).abs().max() > 1e-3
    options = ("--nq", "7", "--position-bias", saved(tmp_path, "alibi.npy", bias[None].float().numpy()))
    assert_passes(*run_case(runner, STYLES, "SymmetricAlibi", None, options))
    assert_named(*run_case(runner, STYLES, "SymmetricAlibi", "bug='slopes_from_zero'", options), "alibi.slopes")
    assert_named(*run_case(runner, STYLES, "SymmetricAlibi", "bug='sign'", options), "alibi.sign")


def test_symmetric_alibi_under_alibi_says_how_to_tell_it(runner):
    """The same correct code traced under --alibi (BLOOM's −m_h · (i − j)) is alibi.query_positions; with no causal
    mask that is a bidirectional encoder's own ALiBi, and the message names the option that describes it."""
    found = assert_named(*run_case(runner, STYLES, "SymmetricAlibi", None, ("--nq", "7", "--alibi")),
                         "alibi.query_positions")
    assert "--position-bias FILE" in found["diagnosis"] and "−m_h · |i − j|" in found["diagnosis"], found


def test_a_scale_of_the_width_hidden_size_over_the_heads_says_so(runner):
    """Nemotron-H's head_dim is set apart from hidden_size / num_heads; a scale of (hidden_size // num_heads) ** -0.5
    (round 60) read '0.288675 is no size of the run': it is 1/√(d_feat / n_head), which the message now says."""
    torch.manual_seed(0)
    m = ApartHeadDim().double().eval()
    x = torch.randn(2, 7, 48, dtype=torch.float64)
    q = m.q_proj(x).view(2, 7, 4, 16).transpose(1, 2)
    k, v = (p(x).view(2, 7, 2, 16).transpose(1, 2).repeat_interleave(2, dim=1) for p in (m.k_proj, m.v_proj))
    with torch.no_grad():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 7, 64)
        assert (m(x) - m.o_proj(out)).abs().max() < 1e-10
    assert_passes(*run_case(runner, STYLES, "ApartHeadDim", None, ("--causal", "--nq", "7")))
    options = ("--causal", "--nq", "7")
    found = assert_named(*run_case(runner, STYLES, "ApartHeadDim", "bug='scale_from_hidden'", options), "scale.other")
    assert "1/√(d_feat / n_head) = 1/√12" in found["diagnosis"], found
