"""`attnscope trace` gives a mask in the code's other forms where the form its ops were read as makes the code's
output not finite, or masks every key of a query in the scores it softmaxes (runs/trace_mask._other_form,
usertrace/maskforms.py): code that merges its 0/1 keep mask with a tensor of its own first (a zero position bias, a
causal buffer) reads as adding a bias, and 0 / -inf gave it NaN, compared as NaN alike and named mask.after_softmax
by experiment on correct code. Styles of our own (tests/trace_styles_round25_maskforms.py), each checked against
F.scaled_dot_product_attention in float64."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _trace_ref import sdpa
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round25_maskforms.py")
styles = user_module(STYLES)


@pytest.fixture()
def files(tmp_path):
    """Key padding [n_batch, n_K] (True = a real token): the first sequence's last two keys padded, the second's
    last."""
    pad = np.ones((2, 7), dtype=bool)
    pad[0, 5:] = False
    pad[1, 6:] = False
    np.save(tmp_path / "pad.npy", pad)
    return {"PAD": str(tmp_path / "pad.npy")}


def _keep() -> torch.Tensor:
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 5:] = False
    keep[1, 6:] = False
    return keep


def test_the_styles_are_masked_attention():
    torch.manual_seed(0)
    keep = _keep()
    padding = keep[:, None, None, :]
    causal = padding & torch.ones(7, 7, dtype=torch.bool).tril()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    m = styles.GPTMergedKeep().double()
    q, k, v = m.c_attn(x).split(32, dim=2)
    want = m.c_proj(sdpa(q, k, v, 4, causal))
    torch.testing.assert_close(m(x, attention_mask=padding.double()), want)
    m = styles.T5ZeroBias().double()
    want = m.o(sdpa(m.q(x), m.k(x), m.v(x), 4, padding, scale=1.0))
    torch.testing.assert_close(m(x, mask=padding.double()), want)
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    m = styles.SummedKeep().double()
    want = m.to_out(sdpa(m.to_q(x), m.to_k(x), m.to_v(x), 3, causal))
    torch.testing.assert_close(m(x, pad_mask=padding.double()), want)


CAUSAL = ("--causal", "--batch", "2", "--nq", "7", "--mask", "PAD")
UNSCALED = ("--scale", "1", "--batch", "2", "--nq", "7", "--mask", "PAD")
CORRECT = [("GPTMergedKeep", None, CAUSAL), ("T5ZeroBias", None, UNSCALED), ("SummedKeep", None, CAUSAL)]
PLANTS = [("GPTMergedKeep", "bug='no_scale'", CAUSAL, "scale.none"),
          ("GPTMergedKeep", "bug='merge_no_transpose'", CAUSAL, "heads.merge_without_transpose"),
          ("T5ZeroBias", "bug='scaled'", UNSCALED, "scale.none"),
          ("T5ZeroBias", "bug='merge_no_transpose'", UNSCALED, "heads.merge_without_transpose"),
          ("SummedKeep", "bug='no_scale'", CAUSAL, "scale.none"),
          ("SummedKeep", "bug='merge_no_transpose'", CAUSAL, "heads.merge_without_transpose")]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    padding = _keep()[:, None, None, :].float()
    for name, init, _, _ in PLANTS:
        good, bad = getattr(styles, name)(), getattr(styles, name)(bug=init.split("'")[1])
        width = 24 if name == "SummedKeep" else 32
        x = torch.randn(2, 7, width)
        assert (good(x, padding) - bad(x, padding)).abs().max() > 1e-3, (name, init)


test_correct_styles_pass = passing_test(STYLES, CORRECT, files="files")
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS, files="files")


def test_the_note_says_which_form_the_code_took(runner, files):
    code, out = run_case(runner, STYLES, "SummedKeep", None, tuple(files.get(o, o) for o in CAUSAL))
    said = [" ".join(n.split()) for n in out["notes"] if "it does not, and is read so" in n]
    assert code == 0 and said and "given float 0/1, 1 = may attend" in said[0], out["notes"]
