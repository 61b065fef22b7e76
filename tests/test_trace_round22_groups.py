"""`attnscope trace` picks gqa.group_order or gqa.tiled, which give the same numbers where n_group = n_kv_head, from
the op the code used (round 22's DBRX: query heads regrouped in an einsum, no `.repeat`, named gqa.tiled because a
rotate_half's torch.cat of the queries, as wide as the repeated keys, read as a repeat). kvtrials._materializes_repeat
now counts only ops on the keys' or values' side. Styles of our own (tests/trace_styles_round22_groups.py), checked
against F.scaled_dot_product_attention(enable_gqa=True) in float64; each plant shown to change the output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round22_groups.py")
styles = user_module(STYLES)


def test_the_styles_are_grouped_query_sdpa():
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    m = styles.RotaryGroupedEinsum().double()
    q = styles.rope(m.wq(x).view(2, 5, 4, 8).transpose(1, 2))
    k = styles.rope(m.wk(x).view(2, 5, 2, 8).transpose(1, 2))
    v = m.wv(x).view(2, 5, 2, 8).transpose(1, 2)
    want = m.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
                .reshape(2, 5, 32))
    assert torch.allclose(m(x), want, atol=1e-10)
    for bug in ("group_order", "tiled"):
        assert (styles.RotaryGroupedEinsum(bug=bug).double()(x) - want).abs().max() > 1e-3, bug

    y = torch.randn(2, 5, 48, dtype=torch.float64)
    m = styles.SplitGroups().double()
    q, k, v = m.qkv(y).split([48, 16, 16], -1)
    q, k, v = (t.view(2, 5, -1, 8).transpose(1, 2) for t in (q, k, v))
    want = m.out(F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).reshape(2, 5, 48))
    assert torch.allclose(m(y), want, atol=1e-10)
    assert (styles.SplitGroups(bug="tiled").double()(y) - want).abs().max() > 1e-3


CORRECT = [("RotaryGroupedEinsum", ("--rope", "--causal")), ("SplitGroups", ())]


@pytest.mark.parametrize(("name", "options"), CORRECT, ids=case_ids(CORRECT))
def test_grouped_einsums_pass(runner, name, options):
    assert_passes(*run_case(runner, STYLES, name, None, options))


PLANTS = [("RotaryGroupedEinsum", "group_order", ("--rope", "--causal"), "gqa.group_order"),
          ("RotaryGroupedEinsum", "tiled", ("--rope", "--causal"), "gqa.tiled"),
          ("SplitGroups", "tiled", (), "gqa.tiled")]


@pytest.mark.parametrize(("name", "bug", "options", "cause"), PLANTS, ids=case_ids(PLANTS))
def test_the_op_the_code_used_picks_the_entry(runner, name, bug, options, cause):
    found = assert_named(*run_case(runner, STYLES, name, f"bug={bug!r}", options), cause)
    assert (".repeat(" in found["diagnosis"]) == (bug == "tiled"), found["diagnosis"]
