"""`attnscope trace` on code that masks by adding two finite biases: the first GPT-2 code adds -10000 for its causal
rule and -10000 more for padding, -20000 where both mask. A softmax over the queries' axis normalizes those masked
numbers as they are, so a rerun masking with one number (-inf, -1e9, or -10000 once) cannot give it back: the
softmax.axis trial also reruns with the code's own masked scores where the code holds them finite
(scaletrials.code_masked). Checked against F.scaled_dot_product_attention in float64."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case

HERE = Path(__file__).resolve().parent
STYLES = str(HERE / "trace_styles_twobiases.py")
styles = user_module(STYLES)
B, N, D, H = 2, 7, 32, 4


def _keep() -> torch.Tensor:
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, 5:] = False
    keep[0, :2] = False  # padded on the left: keys before a query's own, masked twice where also in the future
    return keep


def test_the_style_is_sdpa_and_the_plants_change_it():
    g = torch.Generator().manual_seed(76)
    x = torch.randn(B, N, D, generator=g, dtype=torch.float64)
    keep = _keep()
    m = styles.GPT2First().double()
    q, k, v = (t.view(B, N, H, D // H).transpose(1, 2) for t in m.c_attn(x).split(D, dim=-1))
    allowed = keep[:, None, None, :] & torch.ones(N, N, dtype=torch.bool).tril()
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    want = m.c_proj(o.transpose(1, 2).reshape(B, N, D))
    with torch.no_grad():
        rows = allowed.any(-1).squeeze(1)  # queries that may see some key ([B, N]); the others differ by convention
        assert torch.allclose(m(x, keep.double())[rows], want[rows], atol=1e-10)
        for bug in ("axis", "scale_model"):
            got = styles.GPT2First(bug=bug).double()(x, keep.double())
            assert (got[rows] - want[rows]).abs().max() > 1e-3, bug


@pytest.fixture()
def padding(tmp_path):
    path = tmp_path / "pad.npy"
    np.save(path, _keep().numpy())
    return ("--causal", "--batch", str(B), "--nq", str(N), "--mask", str(path))


def test_two_added_biases_pass(runner, padding):
    assert_passes(*run_case(runner, STYLES, "GPT2First", None, padding))


@pytest.mark.parametrize(("bug", "entry"), [("axis", "softmax.axis"), ("scale_model", "scale.d_model")])
def test_the_plants_are_named(runner, padding, bug, entry):
    assert_named(*run_case(runner, STYLES, "GPT2First", f"bug={bug!r}", padding), entry)
