"""Hiera's mask unit attention at a stage transition (held-out round 53): its queries max-pooled inside each unit,
its keys and values not, each unit's pooled queries against its own keys alone. Correct code got exit 1: no regrouping
of the input holds units whose queries are not their keys. The code's products of the pooled queries and the keys are
now read as pieces of the scores (gathered.py, with a kernel's recomputed scores too) and the keys each query meets as
a mask for the reference (usertrace/unitmask.py), checked by experiment against the tokens each query is made from.

Both styles are first checked against F.scaled_dot_product_attention in float64, the units and the pooling written
out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from trace_styles_pooledunits import MaskUnitAttention, UnitsPooled
from tracecases import assert_named, assert_passes, run_case

STYLES = str(Path(__file__).parent / "trace_styles_pooledunits.py")
B, N = 2, 30  # 5 units of 6 tokens (q_stride 2 · window 3): 3 pooled queries a unit
OPTIONS = ("--nq", str(N))


def _by_hand(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Hiera's unit attention written out: token t in unit t % units, the j-th of its unit (t // units); a unit's
    query r is the max of its tokens j = s · (per / stride) + r; output token r · units + unit."""
    heads, d, stride = m.heads, m.head_dim, m.q_stride
    units, per = N // (stride * m.window_size), stride * m.window_size
    q, k, v = m.qkv(x).view(B, N, 3, heads, d).permute(2, 0, 3, 1, 4)  # [B, heads, N, d] each
    n_q = units * per // stride
    pooled = torch.empty(B, heads, n_q, d, dtype=x.dtype)
    keep = torch.zeros(n_q, N, dtype=torch.bool)
    for unit in range(units):
        for r in range(per // stride):
            tokens = [(s * (per // stride) + r) * units + unit for s in range(stride)]
            pooled[:, :, r * units + unit] = q[:, :, tokens].amax(dim=2)
            keep[r * units + unit, [t for t in range(N) if t % units == unit]] = True
    out = F.scaled_dot_product_attention(pooled, k, v, attn_mask=keep)
    return m.proj(out.transpose(1, 2).reshape(B, n_q, heads * d))


@pytest.mark.parametrize("style", [UnitsPooled, MaskUnitAttention])
def test_the_style_is_its_formula_and_each_plant_changes_it(style):
    torch.manual_seed(0)
    m = style().double().eval()
    x = torch.randn(B, N, 24, dtype=torch.float64)
    got = m(x)
    assert (got - _by_hand(m, x)).abs().max() < 1e-10
    bugs = ("scale_twice", "no_transpose", "units_shifted") + (("softmax_queries",) if style is UnitsPooled else ())
    for bug in bugs:
        planted = style(bug=bug).double().eval()
        planted.load_state_dict(m.state_dict())
        assert (planted(x) - got).abs().max() > 1e-3, bug


@pytest.mark.parametrize("target", ["UnitsPooled", "MaskUnitAttention"])
def test_units_beside_pooled_queries_are_a_convention(runner, target):
    code, out = run_case(runner, STYLES, target, None, OPTIONS)
    assert_passes(code, out)
    assert any("attends within units of its own" in note for note in out["notes"]), out["notes"]


@pytest.mark.parametrize(("target", "bug", "entry"), [
    ("UnitsPooled", "scale_twice", "scale.twice"),
    ("UnitsPooled", "softmax_queries", "softmax.axis"),
    ("UnitsPooled", "no_transpose", "heads.merge_without_transpose"),
    ("MaskUnitAttention", "no_transpose", "heads.merge_without_transpose"),
])
def test_a_mistake_inside_the_units_is_named(runner, target, bug, entry):
    assert_named(*run_case(runner, STYLES, target, f"bug={bug!r}", OPTIONS), entry)


@pytest.mark.parametrize("target", ["UnitsPooled", "MaskUnitAttention"])
def test_queries_against_another_units_keys_are_no_convention(runner, target):
    """Each unit's pooled queries against the next unit's keys: a pairing of pieces too, but the queries' own
    tokens are not among the keys they meet (read by experiment), so it is not read as units."""
    code, out = run_case(runner, STYLES, target, "bug='units_shifted'", OPTIONS)
    assert code == 1 and out["first_divergence"] is not None
    assert not any("attends within units" in note for note in out["notes"])
