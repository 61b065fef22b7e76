"""`attnscope trace` reads a boolean mask's polarity from the module's own default for it, where its ops read the
other (round 22's AllenNLP MultiHeadSelfAttention: `mask = inputs.new_ones(batch, T)` when none is given, ones =
keep; its `masked_fill(mask, min)` plant was read as True = masked out and passed). usertrace/defaultmask.py: in a
run given no mask, the op applying the mask reads a constant of one value that the ops' polarity would mask every
key at; the mask is then given the other way round and the inversion named mask.polarity by experiment. Correct code
still passes. Styles of our own (tests/trace_styles_round22_defaultmask.py), checked against
F.scaled_dot_product_attention in float64; each plant shown to change the output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round22_defaultmask.py")
styles = user_module(STYLES)
KEEP = np.array([[True] * 5 + [False], [True] * 4 + [False] * 2])  # [n_batch, n_K], True = may attend
NAMES = ["OnesDefault", "WhereDefault", "PaddingDefault"]


def _given(name: str, keep: torch.Tensor) -> torch.Tensor:
    return ~keep if name == "PaddingDefault" else keep


@pytest.fixture()
def mask_file(tmp_path):
    def write(name: str) -> str:
        path = tmp_path / "keep_2x6.npy"
        np.save(path, KEEP)  # trace's convention, True = may attend: written in the code's for it
        return str(path)
    return write


def test_the_styles_are_sdpa_under_the_mask():
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    keep = torch.from_numpy(KEEP)
    for name in NAMES:
        cls = getattr(styles, name)
        m = cls().double()
        q, k, v = m.split(x)
        want = m.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :]))
        assert torch.allclose(m(x, _given(name, keep)), want, atol=1e-10), name
        assert torch.allclose(m(x), m.merge(F.scaled_dot_product_attention(q, k, v)), atol=1e-10), name
        assert (cls(bug="polarity").double()(x, _given(name, keep)) - want).abs().max() > 1e-3, name


@pytest.mark.parametrize("name", NAMES)
def test_the_correct_styles_pass(runner, mask_file, name):
    assert_passes(*run_case(runner, STYLES, name, None, ("--batch", "2", "--nq", "6", "--mask", mask_file(name))))


@pytest.mark.parametrize("name", NAMES)
def test_the_inverted_mask_is_named_by_the_default(runner, mask_file, name):
    code, out = run_case(runner, STYLES, name, "bug='polarity'",
                         ("--batch", "2", "--nq", "6", "--mask", mask_file(name)))
    assert_named(code, out, "mask.polarity")
    assert any("your module's own default for it holds" in note for note in out["notes"]), out["notes"]
