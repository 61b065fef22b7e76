"""`attnscope trace` lines up divided and grouped attention (round 23's lucidrains TimeSformer): code that cuts the
tokens into groups after the projection (frames, patches, chunks, strides), moves them into the batch axis, prepends
a shared token's key and value to every group and attends within each, the shared token itself over all. Under the
pattern as --mask (each token sees its group and the shared token) it is the reference's full attention: the code's
pieces of the queries, keys, scores, weights and outputs are read from their values (each row a reference row, each
cell a reference cell: usertrace/gathered.py) and lined up gathered from the reference's steps. Without a shared
token and without --mask, the groups are read as the code's convention (regroup.py). Styles of our own
(tests/trace_styles_round23_divided.py), each checked against F.scaled_dot_product_attention in float64; each plant
shown to change the output and named by experiment."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_passes, passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round23_divided.py")
styles = user_module(STYLES)


def _pattern(n: int, groups: list[list[int]], shared: bool) -> torch.Tensor:
    """True where two tokens share a group; a shared token 0 sees and is seen by all."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for group in groups:
        mask[torch.tensor(group)[:, None], torch.tensor(group)[None, :]] = True
    if shared:
        mask[0, :], mask[:, 0] = True, True
    return mask


TIME = _pattern(7, [[1, 4], [2, 5], [3, 6]], True)  # cls, then 2 frames of 3 patches: a patch across frames
SPACE = _pattern(7, [[1, 2, 3], [4, 5, 6]], True)  # the patches of one frame (ChunkGlobal's chunks of 3 too)
STRIDED = _pattern(6, [[0, 2, 4], [1, 3, 5]], False)
TRAILING = _pattern(8, [[0, 1, 2], [3, 4, 5]], False)
TRAILING[-2:, :], TRAILING[:, -2:] = True, True  # two global tokens at the end


@pytest.fixture
def files(tmp_path):
    paths = {}
    for name, mask in (("TIME", TIME), ("SPACE", SPACE), ("STRIDED", STRIDED), ("TRAILING", TRAILING)):
        np.save(tmp_path / f"{name}.npy", mask.numpy())
        paths[name] = str(tmp_path / f"{name}.npy")
    return paths


def _reference(q, k, v, w_o, mask, x, h=4):
    """Full attention under `mask`, heads merged, projected: F.scaled_dot_product_attention in float64."""
    q, k, v = (t.view(x.shape[0], x.shape[1], h, -1).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return w_o(out.transpose(1, 2).reshape(x.shape))


def test_the_styles_are_full_attention_under_the_pattern():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    for axis, mask in (("time", TIME), ("space", SPACE)):
        m = styles.DividedSpaceTime(axis=axis).double()
        want = _reference(*m.qkv(x).chunk(3, -1), m.proj, mask, x)
        assert torch.allclose(m(x), want, atol=1e-10)
        for bug in ("kv_swapped", "scale_twice", "merge_dh"):
            assert (styles.DividedSpaceTime(axis=axis, bug=bug).double()(x) - want).abs().max() > 1e-3
    m = styles.ChunkGlobal().double()
    want = _reference(m.to_q(x), m.to_k(x), m.to_v(x), m.to_out, SPACE, x)
    assert torch.allclose(m(x), want, atol=1e-10)
    for bug in ("v_from_k", "scale_inverted", "softmax_axis"):
        assert (styles.ChunkGlobal(bug=bug).double()(x) - want).abs().max() > 1e-3
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    m = styles.TrailingGlobals().double()
    want = _reference(*m.qkv(x).chunk(3, -1), m.out, TRAILING, x)
    assert torch.allclose(m(x), want, atol=1e-10)
    assert (styles.TrailingGlobals(bug="local_no_scale").double()(x) - want).abs().max() > 1e-3
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    m = styles.StridedGroups().double()
    want = _reference(*(x @ m.wqkv).chunk(3, -1), m.wo, STRIDED, x)
    assert torch.allclose(m(x), want, atol=1e-10)
    for bug in ("no_scale", "merge_dh", "softmax_axis"):
        assert (styles.StridedGroups(bug=bug).double()(x) - want).abs().max() > 1e-3


CORRECT = [
    ("DividedSpaceTime", None, ("--mask", "TIME", "--nq", "7")),
    ("DividedSpaceTime", "axis='space'", ("--mask", "SPACE", "--nq", "7")),
    ("ChunkGlobal", None, ("--mask", "SPACE", "--nq", "7")),
    ("StridedGroups", None, ("--mask", "STRIDED", "--nq", "6")),
    ("StridedGroups", None, ("--nq", "6")),  # no shared token, no --mask: the groups read as the code's
    ("TrailingGlobals", None, ("--mask", "TRAILING", "--nq", "8")),
]
test_correct_styles_pass = passing_test(STYLES, CORRECT, files="files")

PLANTS = [
    ("DividedSpaceTime", "bug='kv_swapped'", ("--mask", "TIME", "--nq", "7"), "kv.swapped"),
    ("DividedSpaceTime", "axis='space', bug='scale_twice'", ("--mask", "SPACE", "--nq", "7"), "scale.twice"),
    ("DividedSpaceTime", "bug='merge_dh'", ("--mask", "TIME", "--nq", "7"), "heads.merge_wrong_permute"),
    ("ChunkGlobal", "bug='v_from_k'", ("--mask", "SPACE", "--nq", "7"), "kv.values_from_keys"),
    ("ChunkGlobal", "bug='scale_inverted'", ("--mask", "SPACE", "--nq", "7"), "scale.multiplied"),
    ("ChunkGlobal", "bug='softmax_axis'", ("--mask", "SPACE", "--nq", "7"), "softmax.axis"),
    ("StridedGroups", "bug='no_scale'", ("--mask", "STRIDED", "--nq", "6"), "scale.none"),
    ("StridedGroups", "bug='merge_dh'", ("--mask", "STRIDED", "--nq", "6"), "heads.merge_wrong_permute"),
    ("StridedGroups", "bug='softmax_axis'", ("--mask", "STRIDED", "--nq", "6"), "softmax.axis"),
    # the windows' call alone unscaled, the globals' scaled: named in those pieces alone
    ("TrailingGlobals", "bug='local_no_scale'", ("--mask", "TRAILING", "--nq", "8"), "scale.none"),
]
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS, files="files")


def test_the_pieces_are_lined_up_gathered(runner, files):
    """The shared token's own scores and each group's are lined up with the reference's full scores and weights
    under the mask: the rows say the pieces, gathered from the reference's cells."""
    code, out = run_case(runner, STYLES, "ChunkGlobal", None, ("--mask", files["SPACE"], "--nq", "7"))
    assert_passes(code, out)
    rows = {row["reference"]: row for row in out["alignment"]}
    for step in ("scores", "attention"):
        assert rows[step]["status"] == "permuted" and rows[step]["layout"].startswith("gathered: "), rows[step]
        assert "every query's row" in rows[step]["layout"]
