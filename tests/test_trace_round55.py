"""Held-out round 55 (T5, BLOOM, DETR, BLIP, MobileViT, Qwen2-VL vision, Molmo, Pegasus-X): findings in styles
written afresh.

MobileViT takes a feature map `[B, C, H, W]` and unfolds it into `[B·P, N, C]` itself. trace read the map in the
column form, and the regrouping reading (regroup.py) asked for rows, so correct code got exit 1 ("Q_feat ... not its
values"). The column form's map is now read as its rows for the regrouping, the groups run in the row form, and what
the code returns (a map again) compared as its rows, regrouped. A --mask file [n_batch, n, n] for such a module was
refused in the column form ("does not broadcast"), so the map was never tried and the user's code was blamed for the
row input trace made up; it is now read as one mask a sequence there too.

DETR's inline in_proj with the values' block of rows copied from the keys' (`in_proj_weight[E:2E]` twice) was read as
one fused K/V projection split in halves under GQA. The rows no slice reads, as many as the writer's, are now the
values' projection (unused.left_rows), the keys' input side is read from the call that reaches the keys
(posembed.projection_input), and kv.values_from_keys is named by experiment: the value input through the keys'
rows.

Qwen2-VL's 2-D vision rotary applied to the queries alone gave no RoPE reading at all (the angle table was read only
where the queries and keys turn alike), so rope.not_applied had nothing to try. The table is now read from the
queries where the keys are left as projected, and the keys' missing turn is named.

Pegasus-X's local scores are two einsums, the block queries against the global keys ('BHNKF,BHGF->BHNKG', the keys
broadcast over the blocks) and against their own block, joined along the keys' axis by torch.cat before one softmax:
no piece of the scores was read there, so a softmax over the queries went unnamed. An einsum's cells are now paired
by its equation, and products joined along the keys' axis are one piece (gathered._einsum_cells, _joined). BigBird's
(round 54) joins products scaled and masked after them, one viewed back from a bmm, in more than four pieces: a
piece is followed through its elementwise ops and its views, and the softmax over the queries is tried in up to
eight pieces at once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from trace_styles_round55 import AxialRotary, GlobalBlocks, InlineInProj, ManyBlocks, UnfoldedPixels
from tracecases import assert_named, assert_passes, run_case, saved

STYLES = str(Path(__file__).parent / "trace_styles_round55.py")
H, W, P = 4, 6, 2


def _same_pixel() -> np.ndarray:
    """True where two positions of the 4×6 map sit at the same place of their 2×2 patches."""
    rows, cols = np.divmod(np.arange(H * W), W)
    place = (rows % P) * P + cols % P
    return place[:, None] == place[None, :]


def test_the_style_is_its_formula_and_the_plant_changes_it():
    torch.manual_seed(0)
    m = UnfoldedPixels().double().eval()
    x = torch.randn(2, 16, H, W, dtype=torch.float64)
    rows = x.flatten(2).transpose(1, 2)  # [B, 24, 16], raster order
    q, k, v = (t.view(2, H * W, 2, 8).transpose(1, 2) for t in m.qkv_proj(rows).view(2, H * W, 3, 16).unbind(2))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(_same_pixel()))
    want = m.out_proj(out.transpose(1, 2).reshape(2, H * W, 16)).transpose(1, 2).reshape(2, 16, H, W)
    got = m(x)
    assert (got - want).abs().max() < 1e-10
    planted = UnfoldedPixels(bug="kv_swapped").double().eval()
    planted.load_state_dict(m.state_dict())
    assert (planted(x) - got).abs().max() > 1e-3


def test_a_feature_map_unfolded_into_the_batch_is_read_as_groups(runner, tmp_path):
    code, out = run_case(runner, STYLES, "UnfoldedPixels", None, ("--nq", str(H * W)))
    assert_passes(code, out)
    assert any("attends within groups of 6 tokens" in note for note in out["notes"]), out["notes"]
    assert_named(*run_case(runner, STYLES, "UnfoldedPixels", "bug='kv_swapped'", ("--nq", str(H * W))), "kv.swapped")
    mask = saved(tmp_path, "pixels.npy", np.broadcast_to(_same_pixel(), (2, H * W, H * W)).copy())
    options = ("--nq", str(H * W), "--batch", "2", "--mask", mask)
    assert_passes(*run_case(runner, STYLES, "UnfoldedPixels", None, options))


def test_the_inline_in_proj_is_torchs_attention_and_the_plant_changes_it():
    torch.manual_seed(0)
    m = InlineInProj().double().eval()
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).double().eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(m.in_proj_weight)
        mha.in_proj_bias.copy_(m.in_proj_bias)
        mha.out_proj.load_state_dict(m.out_proj.state_dict())
    tgt, pos = torch.randn(2, 7, 32, dtype=torch.float64), torch.randn(2, 7, 32, dtype=torch.float64)
    got = m(tgt, pos)
    assert (got - mha(tgt + pos, tgt + pos, tgt, need_weights=False)[0]).abs().max() < 1e-10
    planted = InlineInProj(bug="v_rows_of_k").double().eval()
    planted.load_state_dict(m.state_dict())
    assert (planted(tgt, pos) - got).abs().max() > 1e-3


def test_the_values_block_taken_from_the_keys_rows_is_named(runner):
    assert_passes(*run_case(runner, STYLES, "InlineInProj", None, ()))
    assert_named(*run_case(runner, STYLES, "InlineInProj", "bug='v_rows_of_k'", ()), "kv.values_from_keys")


def _turned(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x `[.., N, d]` with its pairs (i, i + d/2) turned by `angles` `[N, d/2]`, written with complex numbers."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat([z.real, z.imag], dim=-1)


def test_the_axial_rotary_is_its_formula_and_the_plant_changes_it():
    torch.manual_seed(0)
    m = AxialRotary().double().eval()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    freqs = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    rows, cols = torch.arange(12) // 4, torch.arange(12) % 4
    angles = torch.cat([rows[:, None] * freqs[::2], cols[:, None] * freqs[1::2]], dim=-1)
    q, k, v = (p(x).view(2, 12, 4, 8).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
    out = F.scaled_dot_product_attention(_turned(q, angles), _turned(k, angles), v)
    got = m(x)
    assert (got - m.o_proj(out.transpose(1, 2).reshape(2, 12, 32))).abs().max() < 1e-10
    planted = AxialRotary(bug="keys_unrotated").double().eval()
    planted.load_state_dict(m.state_dict())
    assert (planted(x) - got).abs().max() > 1e-3


def test_a_2d_rotary_left_off_the_keys_is_named(runner):
    assert_passes(*run_case(runner, STYLES, "AxialRotary", None, ("--nq", "12")))
    found = assert_named(*run_case(runner, STYLES, "AxialRotary", "bug='keys_unrotated'", ("--nq", "12")),
                         "rope.not_applied")
    assert "--rope" not in found["diagnosis"], found


def _global_blocks(n: int = 14, n_global: int = 2, block: int = 4) -> np.ndarray:
    """True where a token may attend: the global tokens to all, the others to the global tokens and their block."""
    keep = np.zeros((n, n), dtype=bool)
    keep[:n_global] = True
    keep[:, :n_global] = True
    for start in range(n_global, n, block):
        keep[start:start + block, start:start + block] = True
    return keep


BLOCKED = [(GlobalBlocks, 4), (ManyBlocks, 2)]  # the style and the size of its blocks


@pytest.mark.parametrize(("style", "block"), BLOCKED)
def test_the_blocks_are_their_mask_and_the_plant_changes_it(style, block):
    torch.manual_seed(0)
    m = style().double().eval()
    x = torch.randn(2, 14, 32, dtype=torch.float64)
    q, k, v = (p(x).view(2, 14, 4, 8).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(_global_blocks(block=block)))
    got = m(x)
    assert (got - m.out_proj(out.transpose(1, 2).reshape(2, 14, 32))).abs().max() < 1e-10
    planted = style(bug="softmax_dim").double().eval()
    planted.load_state_dict(m.state_dict())
    assert (planted(x) - got).abs().max() > 1e-3


@pytest.mark.parametrize(("style", "block"), BLOCKED)
def test_a_softmax_over_the_queries_of_pieces_of_the_scores_is_named(runner, tmp_path, style, block):
    mask = saved(tmp_path, "blocks.npy", np.broadcast_to(_global_blocks(block=block), (3, 14, 14)).copy())
    options = ("--mask", mask, "--batch", "3", "--nq", "14")
    assert_passes(*run_case(runner, STYLES, style.__name__, None, options))
    assert_named(*run_case(runner, STYLES, style.__name__, "bug='softmax_dim'", options), "softmax.axis")
