"""`attnscope trace` on modules that hold Linear layers the run never applies to the merge of the heads (round 27b,
HF LUKE's LukeSelfAttention with words only). Before, the output projection was chosen among every Linear the flow did
not give q, k or v, a tie broken by registration order: LUKE's `w2e_query` (held, never called without entities) was
read as the output projection, the correct module failed at x ("none of the usual causes fits") and every plant was
misread (√d_model scaling called "not divided by √d_head", not by experiment). An `out_proj` behind a flag that is off
and a gate Linear on the input were taken the same way. Now the output projection is the Linear the run applies to
what the pattern made, read from the records; where none is, the reference is compared up to the merge (as for
BertSelfAttention). Styles in tests/trace_styles_round27_lukeout.py, each checked here against float64 SDPA.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round27_lukeout.py")
styles = user_module(STYLES)
PADDED = ("--mask", "PAD", "--batch", "2", "--nq", "7")
TARGETS = ("EntityAwareSelfAttention", "FlaggedOutAttention", "InputGatedAttention")


@pytest.fixture()
def files(tmp_path):
    """A key-padding file [n_batch, n_K] (True = a real token)."""
    pad = np.ones((2, 7), dtype=bool)
    pad[0, 5:] = False
    np.save(tmp_path / "pad.npy", pad)
    return {"PAD": str(tmp_path / "pad.npy")}


def _sdpa(q, k, v, heads, allowed):
    """[B, N, h·d] each, float64: F.scaled_dot_product_attention per head, keys masked where `allowed` is False."""
    B, N, D = q.shape
    q, k, v = (t.reshape(B, N, heads, D // heads).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None, None, :])
    return out.transpose(1, 2).reshape(B, N, D)


def test_the_styles_compute_sdpa():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    allowed = torch.ones(2, 7, dtype=torch.bool)
    allowed[0, 5:] = False
    additive = torch.zeros(2, 1, 1, 7, dtype=torch.float64).masked_fill(~allowed[:, None, None, :], -1e9)
    m = styles.EntityAwareSelfAttention().double()
    words, entities = m(x, additive)
    torch.testing.assert_close(words, _sdpa(m.query(x), m.key(x), m.value(x), 4, allowed))
    assert entities is None
    f = styles.FlaggedOutAttention().double()
    torch.testing.assert_close(f(x, additive), _sdpa(f.q_proj(x), f.k_proj(x), f.v_proj(x), 4, allowed))
    g = styles.InputGatedAttention().double()
    want = _sdpa(g.query(x), g.key(x), g.value(x), 4, allowed) * torch.sigmoid(g.gate(x))
    torch.testing.assert_close(g(x, additive), want)


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32)
    additive = torch.zeros(2, 1, 1, 7)
    additive[0, ..., 5:] = -1e9

    def run(module):
        out = module(x, additive)
        return out[0] if isinstance(out, tuple) else out

    for target in TARGETS:
        good = run(getattr(styles, target)())
        for bug in ("scale_d_model", "split_no_permute", "mask_on_queries"):
            assert (good - run(getattr(styles, target)(bug=bug))).abs().max() > 1e-3, (target, bug)


CORRECT = [(target, None, PADDED) for target in TARGETS]
PLANTS = [(target, f"bug='{bug}'", PADDED, entry) for target in TARGETS
          for bug, entry in (("scale_d_model", "scale.d_model"), ("split_no_permute", "heads.split_without_permute"),
                             ("mask_on_queries", "mask.on_queries"))]

test_correct_styles_pass = passing_test(STYLES, CORRECT, files="files")
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS, files="files")
