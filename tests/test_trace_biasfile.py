"""`attnscope trace --position-bias FILE`: the file's shape read before the user's code runs (usertrace/biasfile.py).
Its last two axes set n_Q and n_K where no flag does (a table's first two), a 4-D file's first axis n_batch, so `--nq`
may be left out; a file that fits the scores neither as an additive bias nor as a relative key table is refused in
one line, exit 2, that names both shapes, where the user's code used to meet it first and raise a broadcast error.
The correct runs are checked by trace's own line-up; the styles are checked against float64 formulas in
test_trace_round26_maskrank.py and test_trace_round28_shawbias.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_trace_command import trace
from tracecases import assert_passes

HERE = Path(__file__).resolve().parent
T5 = str(HERE / "trace_styles_round26_maskrank.py") + ":Pix2StructVisionLike"  # position_bias added, --scale 1
SHAW = str(HERE / "trace_styles_round28_shawbias.py") + ":SpeechT5Attention"  # a key table [n_Q, n_K, 16]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("biasfile")
    g = torch.Generator().manual_seed(11)
    paths = {}
    for name, shape in (("t5", (1, 4, 7, 7)), ("batched", (2, 4, 5, 5)), ("table", (6, 6, 16)),
                        ("heads3", (3, 5, 5)), ("flat", (9, 8)), ("extra", (2, 1, 4, 5, 5))):
        paths[name] = str(folder / f"{name}.npy")
        np.save(paths[name], torch.randn(*shape, generator=g).numpy())
    return paths


@pytest.mark.parametrize(("target", "file", "options", "sizes"), [
    (T5, "t5", ("--scale", "1"), {"n_Q": 7, "n_K": 7}),
    (T5, "batched", ("--scale", "1"), {"n_Q": 5, "n_K": 5, "n_batch": 2}),
    (SHAW, "table", (), {"n_Q": 6, "n_K": 6}),
])
def test_the_file_sets_the_sizes_no_flag_sets(runner, files, target, file, options, sizes):
    result, out = trace(runner, target, "--position-bias", files[file], *options)
    assert out is not None, result.stderr
    assert_passes(result.exit_code, out)
    assert {k: out["params"]["sizes"][k] for k in sizes} == sizes


def test_a_flag_still_sets_its_size(runner, files):
    """--nq against the file's own n_Q: the flag wins, and the file that no longer fits is refused."""
    result, _ = trace(runner, T5, "--position-bias", files["t5"], "--scale", "1", "--nq", "6")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and said.count("error:") == 1, said
    assert "[1, 4, 7, 7]" in said and "n_Q = 6" in said and "raised" not in said, said


@pytest.mark.parametrize(("file", "options", "shown"), [
    ("heads3", ("--scale", "1"), "n_head = 4"),  # [3, 5, 5] read as 3 heads before a module of 4
    ("flat", ("--scale", "1", "--nq", "6"), "n_Q = 6, n_K = 6"),
    ("extra", ("--scale", "1"), "[2, 1, 4, 5, 5]"),  # an axis beyond the scores' four
])
def test_a_file_of_neither_shape_is_refused_before_the_code_runs(runner, files, file, options, shown):
    result, _ = trace(runner, T5, "--position-bias", files[file], *options)
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "Traceback" not in result.stderr and said.count("error:") == 1, said
    assert shown in said and "raised" not in said, said
    assert "[.., n_Q, n_K]" in said and "[n_Q, n_K, d_head] = [" in said, said


def test_a_bias_of_fewer_axes_than_the_scores_fits_from_the_right(runner, files):
    """[n_head, n_Q, n_K] before scores [n_batch, n_head, n_Q, n_K] (CPM-Ant's position_bias): no axis to spare."""
    result, out = trace(runner, T5, "--position-bias", files["heads3"], "--scale", "1", "--nq", "5",
                        "--init", "num_attention_heads=3, hidden_size=24")
    assert out is not None, result.stderr
    assert_passes(result.exit_code, out)
