"""--batch where it cannot be: every command that takes --batch refuses a count it cannot run (0 where a batch is
needed, a negative one) in one line that names --batch; trace's --batch 0 (2-D inputs, one sequence: no batch axis)
with a --mask file that holds several sequences (key padding [n_batch, n_K], [n_batch, n_Q, n_K]) is refused in one
line that names --batch and the count the file holds, before anything else. Before, round 23's MPNet self-attention
given `--batch 0 --mask pad_2x7.npy --nq 7` was refused 'mask of shape [2, 7] does not broadcast to the scores'
shape [4, 7, 7]', which does not say that --batch 0 is what does not fit. The styles are round 22's
(tests/trace_styles_round22_maskargs.py), checked there against F.scaled_dot_product_attention; run again with the
--batch said, each passes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_trace_command import trace
from tracecases import assert_passes, case_ids, run_case

from attnscope.cli import app

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round22_maskargs.py")
KEEP = torch.ones(3, 9, dtype=torch.bool)
KEEP[0, 6:] = False
KEEP[2, 7:] = False  # [n_batch, n_K] = [3, 9], True = a real key


@pytest.fixture
def files(tmp_path):
    """Key padding [3, 9] and the same as a mask [n_batch, n_Q, n_K] = [3, 9, 9]."""
    np.save(tmp_path / "pad.npy", KEEP.numpy())
    np.save(tmp_path / "rows.npy", KEEP[:, None, :].expand(3, 9, 9).numpy())
    return {"PAD": str(tmp_path / "pad.npy"), "ROWS": str(tmp_path / "rows.npy")}


def _one_line(result) -> str:
    line = " ".join(result.stderr.split())
    assert result.exit_code == 2 and line.count("error:") == 1 and "Traceback" not in line, line
    return line


# the option's own range, checked as it is parsed (the CLI shows it as one line: "Invalid value for '--batch': 0 is
# not in the range x>=1.")
@pytest.mark.parametrize(("args", "least"), [(["sdpa", "--batch", "0"], 1), (["sdpa", "--batch", "-2"], 1),
                                             (["mha", "--batch", "0"], 1), (["bench", "sdpa", "--batch", "0"], 1),
                                             (["bench", "mha", "--batch", "-1"], 1),
                                             (["trace", f"{STYLES}:SelfPadded", "--batch", "-1"], 0)])
def test_every_command_refuses_a_batch_it_cannot_run_naming_batch(runner, args, least):
    result = runner.invoke(app, args)
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in said, said
    # the least value named: click's words (typer below 0.29: `0 is not in the range x>=1.`) or pydantic's (0.29)
    assert "Invalid value for '--batch'" in said and (f"x>={least}" in said or f"greater than or equal to {least}"
                                                      in said), said


# (target, mask file, what the file is read as, the other flags)
REFUSED = [("SelfPadded", "PAD", "key padding [n_batch, n_K]", ("--nq", "9")),
           ("PerceiverCross", "PAD", "key padding [n_batch, n_K]", ("--nq", "6", "--nk", "9")),
           ("SdpaMemory", "ROWS", "[n_batch, n_Q, n_K]", ("--nq", "9", "--nk", "9")),
           ("padded_attend", "PAD", "key padding [n_batch, n_K]", ("--nq", "6", "--nk", "9", "--heads", "2"))]


@pytest.mark.parametrize(("target", "mask", "reading", "options"), REFUSED, ids=case_ids(REFUSED))
def test_batch_0_with_a_mask_of_several_sequences_is_refused_naming_batch(runner, files, target, mask, reading,
                                                                         options):
    result, out = trace(runner, f"{STYLES}:{target}", "--batch", "0", "--mask", files[mask], *options)
    line = _one_line(result)
    assert out is None and line.startswith("attnscope: error: --batch 0 asks for 2-D inputs"), line
    assert f"is {reading} for 3 sequences: pass --batch 3" in line, line
    if mask == "PAD":  # the flag said makes it run
        assert_passes(*run_case(runner, STYLES, target, None, ("--batch", "3", "--mask", files[mask], *options)))
