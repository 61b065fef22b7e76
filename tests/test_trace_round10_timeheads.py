"""`attnscope trace` on code that takes q, k and v time-first with the heads split, [n, n_batch, n_head, d]
(Megatron-LM's CoreAttention [sq, b, np, hn]): where it raises on [n_batch, n_head, n, d] the other layouts real code
takes are tried ([n_batch, n, n_head, d], then [n, n_batch, n_head, d]), and a width the code merges its heads into
(Megatron's hp = np · kv_channels) sizes d. The correct code passes with a note, its mistakes are named by
experiment (tests/trace_styles_round10_timeheads.py; each checked against F.scaled_dot_product_attention in
float64, each bug shown to change the output)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round10_timeheads.py")
styles = user_module(STYLES)
FN = ("--heads", "4", "--dk", "8", "--dv", "6")


def _sdpa64(q, k, v, allowed=None):
    """[s, b, h, d] in, [s, b, h, d] out."""
    out = F.scaled_dot_product_attention(*(t.double().permute(1, 2, 0, 3) for t in (q, k, v)), attn_mask=allowed)
    return out.permute(2, 0, 1, 3)


def test_the_styles_are_their_formulas_and_the_bugs_change_them():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 2, 4, 8, generator=g), torch.randn(7, 2, 4, 8, generator=g), torch.randn(
        7, 2, 4, 8, generator=g)
    allowed = torch.ones(5, 7, dtype=torch.bool).tril(2)[None, None].expand(2, 1, 5, 7)
    want = _sdpa64(q, k, v, allowed)
    core = styles.TimeFirstCore()
    assert torch.allclose(core(q, k, v, ~allowed).double(), want.reshape(5, 2, 32), atol=1e-5)
    for bug in ("softmax_dim", "no_permute"):
        assert not torch.allclose(styles.TimeFirstCore(bug=bug)(q, k, v, ~allowed), core(q, k, v, ~allowed), atol=1e-3)
    sdpa = styles.TimeFirstSDPA()
    assert torch.allclose(sdpa(q, k, v, allowed).double(), want.reshape(5, 2, 32), atol=1e-5)
    assert not torch.allclose(styles.TimeFirstSDPA(bug="no_permute")(q, k, v, allowed), sdpa(q, k, v, allowed),
                              atol=1e-3)
    right = styles.time_heads_attention(q, k, v)
    assert torch.allclose(right.double(), _sdpa64(q, k, v), atol=1e-5)
    for wrong in (styles.time_heads_attention_over_queries, styles.time_heads_attention_by_d):
        assert not torch.allclose(wrong(q, k, v), right, atol=1e-3)


CASES = [("TimeFirstCore", ("--heads", "4", "--causal"), "softmax_dim", "softmax.axis"),
         ("TimeFirstCore", ("--heads", "4", "--causal"), "no_permute", "heads.merge_without_transpose"),
         ("TimeFirstSDPA", ("--heads", "4", "--causal"), "no_permute", "heads.merge_without_transpose")]


@pytest.mark.parametrize(("name", "args", "bug", "experiment"), CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_a_time_first_core_with_its_heads_split(runner, name, args, bug, experiment):
    result, out = trace(runner, f"{STYLES}:{name}", *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any("[n, n_batch, n_head, d], time-first with the heads split" in n for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug='{bug}'", *args)
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == experiment and first["evidence"].startswith("by experiment"), first


def test_the_width_the_heads_merge_into_sizes_d(runner):
    result, out = trace(runner, f"{STYLES}:TimeFirstCore", "--init", "kv_channels=6", "--heads", "4", "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any(n.startswith("d_K = d_V = 6: your code views its heads merged as 24 = n_head · d") for n in out["notes"])


@pytest.mark.parametrize(("name", "experiment"), [("time_heads_attention_over_queries", "softmax.axis"),
                                                  ("time_heads_attention_by_d", "scale.d_head")])
def test_a_time_first_function_with_its_heads_split(runner, name, experiment):
    result, out = trace(runner, f"{STYLES}:time_heads_attention", *FN)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any("time-first with the heads split" in n for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:{name}", *FN)
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == experiment and first["evidence"].startswith("by experiment"), first


def test_a_run_that_raised_before_its_mask_says_nothing_of_how_it_reads_it(runner):
    result, out = trace(runner, f"{STYLES}:raises_before_its_mask", *FN, "--causal")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert not any("as your code reads it" in n for n in out["notes"]), out["notes"]


def test_heads_merged_with_the_queries_width_size_the_values_alike(runner):
    """d_V was drawn apart from d_K, and code that merges its heads with the queries' d raised on every layout;
    d_V = d_K is then tried, and the core (checked here against SDPA) passes."""
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(5, 2, 3, 8, generator=g), torch.randn(5, 2, 3, 8, generator=g), torch.randn(
        5, 2, 3, 8, generator=g)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    got = styles.QueriesWidthCore()(q.double(), k.double(), v.double(), ~causal)
    assert torch.allclose(got, _sdpa64(q, k, v, causal).reshape(5, 2, 24), atol=1e-10)
    result, out = trace(runner, f"{STYLES}:QueriesWidthCore", "--heads", "3", "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any(n.startswith("d_K = d_V = 8: your code views its heads merged as 24") for n in out["notes"])
