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
from trace_styles_round60 import ImageWindows
from tracecases import assert_named, assert_passes, run_case

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
