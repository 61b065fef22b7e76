"""A --mask file given to an optional mask argument (default None) the code raises on is taken back: the code runs
again with the argument at its default, the file the reference's mask alone, and a note says so. Round 23's
TimeSformer (lucidrains) took the whole [n, n] pattern in `mask`, which it applies to its regrouped sequences (a
frame's padding), and raised: 'your code raised' on correct code, its 4 plants never run. Code that raises at the
default as well is reported as before, on its first failure. Styles of our own
(tests/trace_styles_round23_maskdefault.py), each checked against F.scaled_dot_product_attention in float64 over the
whole sequence with the file's pattern as its boolean mask."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round23_maskdefault.py")
styles = user_module(STYLES)


def _patterns() -> dict[str, torch.Tensor]:
    """True = may attend, [n, n]: Swin's 2 x 2 windows of a 4 x 4 grid, the columns of a 2 x 4 grid, 2 frames of 4."""
    i = torch.arange(16)
    row, col = i // 4, i % 4
    j = torch.arange(8)
    return {"SWIN": (row[:, None] // 2 == row[None] // 2) & (col[:, None] // 2 == col[None] // 2),
            "COLS": j[:, None] % 4 == j[None] % 4, "FRAMES": j[:, None] // 4 == j[None] // 4}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("maskdefault")
    for name, pattern in _patterns().items():
        np.save(folder / f"{name.lower()}.npy", pattern.numpy())
    return {name: str(folder / f"{name.lower()}.npy") for name in _patterns()}


def _sdpa(x, q, k, v, out, heads, pattern):
    b, n, _ = x.shape
    split = [t(x).view(b, n, heads, -1).transpose(1, 2) for t in (q, k, v)]
    y = F.scaled_dot_product_attention(*split, attn_mask=pattern)
    return out(y.transpose(1, 2).reshape(b, n, -1))


def test_the_styles_attend_as_the_files_pattern():
    torch.manual_seed(0)
    pattern = _patterns()
    x = torch.randn(2, 16, 16, dtype=torch.float64)
    m = styles.WindowAttention().double()
    q, k, v = (lambda t, i=i: m.qkv(t).chunk(3, -1)[i] for i in range(3))
    torch.testing.assert_close(m(x), _sdpa(x, q, k, v, m.proj, 2, pattern["SWIN"]))
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    m = styles.AxialColumns().double()
    k, v = (lambda t, i=i: m.to_kv(t).chunk(2, -1)[i] for i in range(2))
    torch.testing.assert_close(m(x), _sdpa(x, m.to_q, k, v, m.to_out, 2, pattern["COLS"]))
    m = styles.FrameSpatial().double()
    torch.testing.assert_close(m(x), _sdpa(x, m.q_proj, m.k_proj, m.v_proj, m.o_proj, 2, pattern["FRAMES"]))


def test_the_mask_argument_means_another_shape_and_the_plants_change_the_output():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    with pytest.raises(RuntimeError):
        styles.AxialColumns()(x, _patterns()["COLS"])  # the whole pattern is no column's key padding
    for name, bug in (("AxialColumns", "softmax_axis"), ("AxialColumns", "merge_no_transpose"),
                      ("FrameSpatial", "d_model")):
        assert (getattr(styles, name)()(x) - getattr(styles, name)(bug=bug)(x)).abs().max() > 1e-3
    x = torch.randn(2, 16, 16)
    for bug in ("kv_swapped", "no_scale"):
        assert (styles.WindowAttention()(x) - styles.WindowAttention(bug=bug)(x)).abs().max() > 1e-3


CORRECT = [("WindowAttention", "16", "SWIN"), ("AxialColumns", "8", "COLS"), ("FrameSpatial", "8", "FRAMES")]


@pytest.mark.parametrize(("target", "n", "file"), CORRECT, ids=case_ids(CORRECT))
def test_the_code_runs_at_its_default_and_the_file_is_the_references(runner, files, target, n, file):
    code, out = run_case(runner, STYLES, target, None, ("--nq", n, "--batch", "2", "--mask", files[file]))
    assert_passes(code, out)
    said = " ".join(" ".join(out["notes"]).split())
    parameter = "attention_mask" if target == "FrameSpatial" else "mask"
    assert f"{parameter} = None: your code raised with the --mask file {Path(files[file]).name} given to " \
           f"{parameter}" in said, said
    assert "the file is the reference's mask alone" in said and "takes no mask" not in said, said


PLANTS = [("WindowAttention", "kv_swapped", "16", "SWIN", "kv.swapped"),
          ("WindowAttention", "no_scale", "16", "SWIN", "scale.none"),
          ("AxialColumns", "softmax_axis", "8", "COLS", "softmax.axis"),
          ("AxialColumns", "merge_no_transpose", "8", "COLS", "heads.merge_without_transpose"),
          ("FrameSpatial", "d_model", "8", "FRAMES", "scale.d_model")]


@pytest.mark.parametrize(("target", "bug", "n", "file", "entry"), PLANTS, ids=case_ids(PLANTS))
def test_the_plants_are_named_by_experiment(runner, files, target, bug, n, file, entry):
    code, out = run_case(runner, STYLES, target, f"bug={bug!r}", ("--nq", n, "--batch", "2", "--mask", files[file]))
    assert_named(code, out, entry)


def test_code_that_raises_at_its_default_too_is_reported_on_its_first_failure(runner, files):
    result, out = trace(runner, f"{STYLES}:NeedsItsMask", "--nq", "8", "--batch", "2", "--mask", files["COLS"])
    assert result.exit_code == 1 and out is not None, result.stdout + result.stderr
    said = out["error"]["message"]
    assert out["error"]["line"] and "The size of tensor a (2) must match the size of tensor b (8)" in said, said
    assert not any("default" in note for note in out["notes"]), out["notes"]
