"""`attnscope trace` on inputs, queries, keys and values of other shapes than `[n_batch, n, d_feat]` from the forward's
one input (round 15b's SAM, CaiT, Hiera and a Linformer): each read from the run as a convention (a note, exit 0),
the mistakes after it named by experiment. Styles of its own (tests/trace_styles_round15_shapes.py), each checked
against F.scaled_dot_product_attention in float64, each plant shown to change the output:
- an input laid out as an image `[B, H, W, C]`: handed one, its tokens in raster order the reference's n_Q (a
  4-D --q file says the same);
- queries read from some of the input's tokens (a class token, the last tokens, a pooled token): n_Q their count;
- queries, keys or values pooled along the tokens after their projection: the reference attends over the code's
  own pooled tensors, n_Q or n_K their length; a layout with an axis of 1 put in (one mask unit) lines up.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from trace_round14_helpers import heads, merged, moved, planted

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round15_shapes.py")
styles = user_module(STYLES)


def _lin(layer, x):
    return F.linear(x, layer.weight, layer.bias)


def _attend(q, k, v, out):
    """SDPA on [b, n, h·d] queries, keys and values (4 heads), merged and projected by `out`."""
    return _lin(out, merged(F.scaled_dot_product_attention(heads(q), heads(k), heads(v))))


def _changed(cls, ours, bug, *args, **init):
    return (planted(cls, ours, bug, *args, **init) - ours(*args)).abs().max() > 1e-3


def test_the_image_styles_are_sdpa_over_their_tokens_in_raster_order():
    x = torch.randn(2, 3, 5, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    t = x.flatten(1, 2)  # [2, 15, 32], raster order
    with torch.no_grad():
        sam = moved(styles.ImageEncoderAttention())
        q, k, v = _lin(sam.qkv, t).chunk(3, -1)
        assert torch.allclose(sam(x).flatten(1, 2), _attend(q, k, v, sam.proj), atol=1e-10)
        for bug in ("unscaled", "merge"):
            assert _changed(styles.ImageEncoderAttention, sam, bug, x)
        nhwc = moved(styles.ChannelsLastAttention())
        want = _attend(_lin(nhwc.to_q, t), _lin(nhwc.to_k, t), _lin(nhwc.to_v, t), nhwc.to_out)
        assert torch.allclose(nhwc(x).flatten(1, 2), want, atol=1e-10)
        assert _changed(styles.ChannelsLastAttention, nhwc, "axis", x)
        grid = moved(styles.WindowlessNHWC())
        k, v = _lin(grid.kv, t).chunk(2, -1)  # its kv laid out [2, heads, d]: the keys first
        assert torch.allclose(grid(x).flatten(1, 2), _attend(_lin(grid.q, t), k, v, grid.out), atol=1e-10)
        assert _changed(styles.WindowlessNHWC, grid, "values", x)


@pytest.mark.parametrize(("name", "bug", "experiment"), [
    ("ImageEncoderAttention", "unscaled", "scale.none"),
    ("ImageEncoderAttention", "merge", "heads.merge_without_transpose"),
    ("ChannelsLastAttention", "axis", "softmax.axis"),
    ("WindowlessNHWC", "values", "kv.values_from_keys")])
def test_an_image_input_is_handed_as_one_and_its_plants_are_named(runner, name, bug, experiment):
    result, out = trace(runner, f"{STYLES}:{name}")
    assert result.exit_code == 0, result.stdout + result.stderr
    said = " ".join(out["notes"])
    assert "your module takes its input as an image, [n_batch, n_h, n_w, d_feat]" in said, said
    sizes = out["params"]["sizes"]
    assert sizes["n_Q"] == sizes["n_K"] and f"the reference's n_Q = {sizes['n_Q']}" in said, (sizes, said)
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == experiment and first["evidence"].startswith("by experiment"), first


def test_a_4d_file_is_an_image_and_nq_lays_the_grid_out(runner, tmp_path):
    path = tmp_path / "image.npy"
    np.save(path, np.random.default_rng(0).standard_normal((2, 3, 4, 32)).astype(np.float32))
    result, out = trace(runner, f"{STYLES}:ImageEncoderAttention", "--q", str(path))
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["params"]["sizes"]["n_Q"] == 12 and out["params"]["sizes"]["n_batch"] == 2, out["params"]["sizes"]
    result, out = trace(runner, f"{STYLES}:ChannelsLastAttention", "--nq", "9")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "= [.., 3, 3, ..]" in " ".join(out["notes"]), out["notes"]


def test_the_selected_query_styles_are_sdpa_of_those_tokens():
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        cls = moved(styles.ClassTokenAttention())
        k, v = _lin(cls.kv, x).view(2, 7, 2, 32).unbind(2)
        assert torch.allclose(cls(x), _attend(_lin(cls.q, x[:, :1]), k, v, cls.proj), atol=1e-10)
        assert _changed(styles.ClassTokenAttention, cls, "twice", x)
        last = moved(styles.LastTokensQuery())
        want = _attend(_lin(last.to_q, x[:, -2:]), _lin(last.to_k, x), _lin(last.to_v, x), last.to_out)
        assert torch.allclose(last(x), want, atol=1e-10)
        assert _changed(styles.LastTokensQuery, last, "merge", x)
        pool = moved(styles.MeanQueryPool())
        want = _attend(_lin(pool.wq, x.mean(1, keepdim=True)), _lin(pool.wk, x), _lin(pool.wv, x), pool.wo)
        assert torch.allclose(pool(x), want, atol=1e-10)
        assert _changed(styles.MeanQueryPool, pool, "unscaled", x)


@pytest.mark.parametrize(("name", "n_Q", "bug", "experiment"), [
    ("ClassTokenAttention", 1, "twice", "scale.twice"),
    ("LastTokensQuery", 2, "merge", "heads.merge_without_transpose"),
    ("MeanQueryPool", 1, "unscaled", "scale.none")])
def test_queries_from_some_tokens_are_the_queries_input_side(runner, name, n_Q, bug, experiment):
    result, out = trace(runner, f"{STYLES}:{name}")
    assert result.exit_code == 0, result.stdout + result.stderr
    said = " ".join(out["notes"])
    assert f"reads {n_Q} of the 7 tokens of your input" in said and "the queries' input side" in said, said
    assert out["params"]["sizes"]["n_Q"] == n_Q and out["params"]["sizes"]["n_K"] == 7, out["params"]["sizes"]
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == experiment and first["evidence"].startswith("by experiment"), first


def test_the_pooled_styles_are_sdpa_over_what_they_pool():
    g = torch.Generator().manual_seed(0)
    x10, x12 = (torch.randn(2, n, 32, generator=g, dtype=torch.float64) for n in (10, 12))
    with torch.no_grad():
        lin = moved(styles.ProjectedSequence())
        k = torch.einsum("bnd,nk->bkd", _lin(lin.to_k, x10), lin.proj_k)
        v = torch.einsum("bnd,nk->bkd", _lin(lin.to_v, x10), lin.proj_v)
        assert torch.allclose(lin(x10), _attend(_lin(lin.to_q, x10), k, v, lin.to_out), atol=1e-10)
        for bug in ("values", "twice"):
            assert _changed(styles.ProjectedSequence, lin, bug, x10)
        mvit = moved(styles.PooledHeads())
        q, k, v = (F.avg_pool1d(t.transpose(1, 2), 2, 2).transpose(1, 2) for t in _lin(mvit.qkv, x12).chunk(3, -1))
        assert torch.allclose(mvit(x12), _attend(q, k, v, mvit.proj), atol=1e-10)
        assert _changed(styles.PooledHeads, mvit, "axis", x12)
        conv = moved(styles.StridedKeyValues())
        k, v = F.conv1d(_lin(conv.kv_proj, x12).transpose(1, 2), conv.pool, stride=2, groups=64).transpose(1, 2) \
            .chunk(2, -1)
        assert torch.allclose(conv(x12), _attend(_lin(conv.q_proj, x12), k, v, conv.o_proj), atol=1e-10)
        assert _changed(styles.StridedKeyValues, conv, "swapped", x12)
        for stride in (1, 2):
            unit = moved(styles.OneMaskUnit(q_stride=stride))
            q, k, v = _lin(unit.qkv, x12).chunk(3, -1)
            q = q.view(2, stride, -1, 32).amax(1)  # token i·(12/stride) + j pooled over i
            assert torch.allclose(unit(x12), _attend(q, k, v, unit.proj), atol=1e-10)
            assert _changed(styles.OneMaskUnit, unit, "twice", x12, q_stride=stride)


@pytest.mark.parametrize(("name", "nq", "init", "roles", "bug", "experiment"), [
    ("ProjectedSequence", 10, "", {"n_Q": 10, "n_K": 4}, "values", "kv.values_from_keys"),
    ("ProjectedSequence", 10, "", {"n_Q": 10, "n_K": 4}, "twice", "scale.twice"),
    ("PooledHeads", 12, "", {"n_Q": 6, "n_K": 6}, "axis", "softmax.axis"),
    ("StridedKeyValues", 12, "", {"n_Q": 12, "n_K": 6}, "swapped", "kv.swapped"),
    ("OneMaskUnit", 12, "q_stride=2, ", {"n_Q": 6, "n_K": 12}, "twice", "scale.twice")])
def test_pooled_after_the_projection_is_read_and_its_plants_are_named(runner, name, nq, init, roles, bug, experiment):
    result, out = trace(runner, f"{STYLES}:{name}", "--nq", str(nq), *(("--init", init.rstrip(", ")) if init else ()))
    assert result.exit_code == 0, result.stdout + result.stderr
    said = " ".join(out["notes"])
    assert "along the tokens after their projection" in said and "a convention, not a mistake" in said, said
    assert {d: out["params"]["sizes"][d] for d in roles} == roles, out["params"]["sizes"]
    statuses = {row["reference"]: row["status"] for row in out["alignment"]}
    assert statuses["x"] == "equal" and statuses["scores"] in ("equal", "permuted"), statuses
    result, out = trace(runner, f"{STYLES}:{name}", "--nq", str(nq), "--init", f"{init}bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == experiment and first["evidence"].startswith("by experiment"), first


def test_one_mask_unit_lines_up_with_its_axis_of_1(runner):
    result, out = trace(runner, f"{STYLES}:OneMaskUnit")
    assert result.exit_code == 0, result.stdout + result.stderr
    rows = {row["reference"]: row for row in out["alignment"]}
    assert rows["scores"]["status"] == "permuted" and "with an axis of 1 put in" in rows["scores"]["layout"], rows
    result, out = trace(runner, f"{STYLES}:OneMaskUnit", "--init", "bug='twice'")
    assert result.exit_code == 1 and out["first_divergence"]["experiment"] == "scale.twice", out["first_divergence"]


def _grouped_attend(q, k, v, out, allowed):
    """SDPA on [b, n, h·d] queries, keys and values under a group mask [n_Q, n_K], merged and projected."""
    return _lin(out, merged(F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=allowed)))


def test_the_grouped_styles_are_sdpa_under_their_group_mask():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 32, generator=g, dtype=torch.float64)
    t = torch.arange(12)
    with torch.no_grad():
        units = moved(styles.StridedUnits())
        q, k, v = _lin(units.qkv, x).chunk(3, -1)
        strided = (t % 3)[:, None] == (t % 3)[None, :]  # token t in unit t % 3
        assert torch.allclose(units(x), _grouped_attend(q, k, v, units.proj, strided), atol=1e-10)
        assert _changed(styles.StridedUnits, units, "twice", x)
        local = moved(styles.LocalBlocks())
        k, v = _lin(local.to_kv, x).chunk(2, -1)
        blocks = (t // 3)[:, None] == (t // 3)[None, :]  # contiguous blocks of 3
        assert torch.allclose(local(x), _grouped_attend(_lin(local.to_q, x), k, v, local.to_out, blocks), atol=1e-10)
        assert _changed(styles.LocalBlocks, local, "values", x)
        block = moved(styles.PaddedWindowBlock())
        image = torch.randn(2, 3, 3, 32, generator=g, dtype=torch.float64)
        # the 3×3 grid padded to 4×4 with zeros after the norm, windows of 2×2: the padded tokens are keys too
        padded = F.pad(F.layer_norm(image, (32,), block.norm.weight, block.norm.bias), (0, 0, 0, 1, 0, 1))
        tokens = padded.flatten(1, 2)  # [2, 16, 32]
        r, c = torch.arange(16) // 4, torch.arange(16) % 4
        windows = ((r // 2) * 2 + c // 2)[:, None] == ((r // 2) * 2 + c // 2)[None, :]
        q, k, v = _lin(block.qkv, tokens).chunk(3, -1)
        want = _grouped_attend(q, k, v, block.proj, windows).view(2, 4, 4, 32)[:, :3, :3] + image
        assert torch.allclose(block(image), want, atol=1e-10)
        assert _changed(styles.PaddedWindowBlock, block, "twice", image)


@pytest.mark.parametrize(("name", "nq", "said", "bug", "experiment"), [
    ("StridedUnits", 12, "tokens 0, 3, … 9 (3 apart)", "twice", "scale.twice"),
    ("LocalBlocks", 12, "tokens 0 to 2", "values", "kv.values_from_keys"),
    ("PaddedWindowBlock", 9, "tokens of zeros pad each sequence's", "twice", "scale.twice")])
def test_groups_made_after_the_projection_or_padded_are_read(runner, name, nq, said, bug, experiment):
    result, out = trace(runner, f"{STYLES}:{name}", "--nq", str(nq))
    assert result.exit_code == 0, result.stdout + result.stderr
    notes = " ".join(out["notes"])
    assert "your code attends within groups of" in notes and said in notes, notes
    result, out = trace(runner, f"{STYLES}:{name}", "--nq", str(nq), "--init", f"bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == experiment and first["evidence"].startswith("by experiment"), first
