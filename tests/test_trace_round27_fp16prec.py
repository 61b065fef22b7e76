"""`attnscope trace` on attention computed in float16 by design (tests/trace_styles_round27_fp16prec.py): finite,
it is a convention, said in a note, exit 0; the reference is run again in the code's dtypes from its own heads
(usertrace/halfprec.py) and gives its tensors back to float16's tolerance. Before, large scores below 65504 (query
and key weights x40-x80) parted from the float64 reference by float16's rounding, and trace named nothing, or at
x80 scale.none by a coincidence of precision. Past 65504 it is float16.overflow, its rerun from the code's own
float16 projections (the count of infs the code's); other mistakes in a float16 module (scale.none, softmax.axis)
are named by their run in float16. Three styles: heads on their own axis, folded head-major, projections in
float16; each correct one checked against F.scaled_dot_product_attention in float64."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from _trace_ref import sdpa
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, plants_test, run_case

from attnscope.usertrace.inputs import input_seed

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round27_fp16prec.py")
styles = user_module(STYLES)
OWN = ("--scale", repr(1 / math.sqrt(32)))  # MAB divides by √dim_V


def test_the_styles_are_sdpa():
    """At small weights float16 barely rounds: each style is float64 SDPA to float16's precision."""
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32)
    close = {"atol": 5e-3, "rtol": 5e-3}
    m = styles.HalfHeads(big=1.0)
    q, k, v = m.qkv(x).double().chunk(3, -1)
    torch.testing.assert_close(m(x).double(), m.proj.double()(sdpa(q, k, v, 4)), **close)
    m = styles.HalfMAB(big=1.0)
    want = sdpa(m.fc_q(x).double(), m.fc_k(x).double(), m.fc_v(x).double(), 4, scale=1 / math.sqrt(32))
    torch.testing.assert_close(m(x).double(), m.fc_o.double()(want), **close)
    m = styles.HalfProjections(big=1.0)
    want = sdpa(m.q_proj(x).double(), m.k_proj(x).double(), m.v_proj(x).double(), 4)
    torch.testing.assert_close(m(x).double(), m.o_proj.double()(want), **close)


def test_large_scores_stay_finite_and_overflow_past_65504():
    torch.manual_seed(0)
    x = torch.randn(3, 7, 32)
    for name in ("HalfHeads", "HalfMAB", "HalfProjections"):
        assert torch.isfinite(getattr(styles, name)()(x)).all(), name
        assert not torch.isfinite(getattr(styles, name)(big=300.0)(x)).all(), name


CORRECT = [("HalfHeads", None, ()), ("HalfHeads", "bug='half', big=80.0", ()),  # the round 27 plant, finite
           ("HalfMAB", None, OWN), ("HalfProjections", None, ())]


def test_float16_by_design_is_a_note(runner):
    for target, init, options in CORRECT:
        code, out = run_case(runner, STYLES, target, init, options)
        assert_passes(code, out)
        said = [n for n in out["notes"] if "float16" in n and "a convention, not a mistake" in n]
        assert said and "scale.none" not in " ".join(out["notes"]), (target, out["notes"])


def test_the_round27_plant_below_65504_is_rounding(runner):
    """round 27's float16 plant (tests/trace_styles_round27_float16.py) with weights x80: q @ kᵀ in float16, finite."""
    styles27 = str(Path(__file__).resolve().parent / "trace_styles_round27_float16.py")
    code, out = run_case(runner, styles27, "FusedHeads", "bug='half', big=80.0")
    assert_passes(code, out)
    assert any("float16: its tensors differ" in n for n in out["notes"]), out["notes"]


def test_overflow_counts_the_codes_infs(runner):
    """Projections in float16: the rerun runs from the code's own float16 heads, so its infs are the code's."""
    m = styles.HalfProjections(big=300.0)
    code, out = run_case(runner, STYLES, "HalfProjections", "big=300.0")
    found = assert_named(code, out, "float16.overflow")
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(input_seed(0)))  # trace's input at --seed 0
    q, k = m._heads(x, m.q_proj), m._heads(x, m.k_proj)
    assert f"{int(torch.isinf(q @ k.transpose(-1, -2)).sum())} scores passed it" in found["diagnosis"]


PLANTS = [("HalfHeads", "big=300.0", (), "float16.overflow"),
          ("HalfMAB", "big=300.0", OWN, "float16.overflow"),
          ("HalfHeads", "bug='no_scale'", (), "scale.none"),
          ("HalfMAB", "bug='no_scale'", OWN, "scale.none"),
          ("HalfProjections", "bug='axis'", (), "softmax.axis"),
          ("HalfMAB", "bug='axis'", OWN, "softmax.axis")]

test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)
