"""`attnscope trace` names q @ kᵀ computed in float16 (float16.overflow) where the code applies its own scale after
the matmul: Set Transformer's MAB folds the heads into the batch (`torch.cat(X.split(d, 2), 0)`) and divides by
√dim_V, not √d_head. The float16 run alone kept the reference's scale, and the pair that joins it to the code's
own scale was never tried: the pairs' count of the cells a run gets right (pairs.by_pair) counted no overflowed
cell, an inf in both, so the float16 run moved nothing closer. An inf met by the same inf now counts, the pair is
tried, and the code's scale, which alone leaves the output as it is, is said as its convention. Styles of our own
(tests/trace_styles_round27_float16.py): heads folded head-major, folded by diffusers' head_to_batch_dim, and kept
on their own axis; each correct one checked against F.scaled_dot_product_attention in float64."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from _trace_ref import sdpa
from test_trace_command import user_module
from tracecases import passing_test, plants_test

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round27_float16.py")
styles = user_module(STYLES)
OWN = ("--scale", repr(1 / math.sqrt(32)))  # MAB divides by √dim_V


def _head_major(m, x):
    """MAB's heads are folded head-major and merged back alike: per head, the columns h·d .. (h + 1)·d."""
    return m.fc_o(sdpa(m.fc_q(x), m.fc_k(x), m.fc_v(x), 4, scale=1 / math.sqrt(32)))


def test_the_styles_are_sdpa():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    m = styles.SetMAB().double()
    torch.testing.assert_close(m(x), _head_major(m, x))
    m = styles.BatchDimAttention().double()
    torch.testing.assert_close(m(x), m.to_out[0](sdpa(m.to_q(x), m.to_k(x), m.to_v(x), 4)))
    m = styles.FusedHeads().double()
    q, k, v = m.qkv(x).chunk(3, -1)
    torch.testing.assert_close(m(x), m.proj(sdpa(q, k, v, 4)))


def test_the_plants_overflow():
    """Each plant's scores pass float16's 65504 (inf) where the correct style's stay finite."""
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32)
    for name in ("SetMAB", "BatchDimAttention", "FusedHeads"):
        good, bad = getattr(styles, name)(), getattr(styles, name)(bug="half")
        assert torch.isfinite(good(x)).all()
        assert not torch.isfinite(bad(x)).all() or (good(x) - bad(x)).abs().max() > 1e-3, name


CORRECT = [("SetMAB", None, OWN), ("BatchDimAttention", None, ()), ("FusedHeads", None, ())]
PLANTS = [("SetMAB", "bug='half'", (), "float16.overflow"),  # the code's own scale, untold: the case
          ("SetMAB", "bug='half'", OWN, "float16.overflow"),
          ("BatchDimAttention", "bug='half'", (), "float16.overflow"),
          ("FusedHeads", "bug='half'", (), "float16.overflow")]

test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)
