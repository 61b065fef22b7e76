"""`attnscope trace` on attention whose q, k and v weights are one packed parameter the code cuts itself before it
projects (torch's F._in_projection: `in_proj_weight.chunk(3)`, `[E:2 * E]`, `torch.split(qkv.weight, [dq, dk, dv])`,
a `[3, E, E]` view unbound, a stacked parameter's `W[i]` in F.linear or an einsum; F._in_projection_packed's one
F.linear and `unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2)`), and on nn.MultiheadAttention (and
F.multi_head_attention_forward) used as a library with `attn_mask=~mask` beside key_padding_mask under a padding
--mask file (round 19's in_proj kind). Each cut of whole rows is a weight of its own, its role read from the data
flow, k and v held by the code's words where they contradict the use; a mask per sequence goes to MHA's attn_mask as
`[n_batch·n_head, n_Q, n_K]`. Styles of our own (tests/trace_styles_round19_inproj.py), each checked against
F.scaled_dot_product_attention in float64, each plant shown to change its output.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from trace_round14_helpers import heads, merged, planted
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round19_inproj.py")
styles = user_module(STYLES)


def _keep():
    keep = torch.ones(2, 7, dtype=torch.bool)  # [n_batch, n_K], True = may attend
    keep[0, 4:] = False
    keep[1, 6:] = False
    return keep


def _changed(out, want):
    return not torch.allclose(out, want, atol=1e-3)  # a NaN (a query the plant leaves no key) is a change


def _rows(w, b, start, stop):
    return lambda t: t @ w[start:stop].T + b[start:stop]


def _sdpa(q, k, v, allowed=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    memory = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()  # True = may attend
    padding = _keep()[:, None, None, :]  # [n_batch, 1, 1, n_K]
    with torch.no_grad():
        m = styles.TimeFirstInProjection().double().eval()
        w, b = m.in_proj_weight, m.in_proj_bias
        q, k, v = (heads(_rows(w, b, 32 * i, 32 * i + 32)(t)) for i, t in enumerate((x, memory, memory)))
        want = m.out_proj(merged(_sdpa(q, k, v, causal)))  # [b, n, E]
        tf = (x.transpose(0, 1), memory.transpose(0, 1), memory.transpose(0, 1), ~causal)  # time-first, True = masked
        assert torch.allclose(m(*tf).transpose(0, 1), want, atol=1e-10)
        for bug in ("kv_swapped", "polarity", "scale_none"):
            assert _changed(planted(styles.TimeFirstInProjection, m, bug, *tf).transpose(0, 1), want)

        m = styles.PackedProjection().double().eval()
        w, b = m.in_proj_weight, m.in_proj_bias
        q, k, v = (heads(_rows(w, b, 32 * i, 32 * i + 32)(x)) for i in range(3))
        want = m.out_proj(merged(_sdpa(q, k, v, causal)))
        assert torch.allclose(m(x, causal), want, atol=1e-10)
        for bug in ("kv_swapped", "scale_d_head", "merge"):
            assert _changed(planted(styles.PackedProjection, m, bug, x, causal), want)

        m = styles.SplitGqaWeight().double().eval()
        w, b = m.qkv.weight, m.qkv.bias
        q, k, v = heads(_rows(w, b, 0, 32)(x)), heads(_rows(w, b, 32, 48)(x), 2), heads(_rows(w, b, 48, 64)(x), 2)
        want = m.wo(merged(_sdpa(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal)))
        assert torch.allclose(m(x, causal), want, atol=1e-10)
        for bug in ("kv_swapped", "tiled", "polarity"):
            assert _changed(planted(styles.SplitGqaWeight, m, bug, x, causal), want)

        m = styles.StackedEinsum().double().eval()
        kernel = m.qkv_kernel.flatten(1, 2)  # [3, n_head·d_head, d_model]: each a Linear's weight
        q, k, v = (heads(x @ kernel[i].T) for i in range(3))
        want = merged(_sdpa(q, k, v, causal)) @ m.o_kernel.flatten(0, 1)
        assert torch.allclose(m(x, causal), want, atol=1e-10)
        for bug in ("kv_swapped", "scale_twice", "softmax_axis"):
            assert _changed(planted(styles.StackedEinsum, m, bug, x, causal), want)

        m = styles.ViewUnbind().double().eval()
        w, b = m.in_proj_weight, m.in_proj_bias
        q, k, v = (heads(_rows(w, b, 32 * i, 32 * i + 32)(t)) for i, t in enumerate((x, memory, memory)))
        want = m.out_proj(merged(_sdpa(q, k, v, padding)))
        assert torch.allclose(m(x, memory, ~_keep()), want, atol=1e-10)
        for bug in ("kv_swapped", "polarity"):
            assert _changed(planted(styles.ViewUnbind, m, bug, x, memory, ~_keep()), want)

        m = styles.StackedLinear().double().eval()
        q, k, v = (heads(x @ m.w[i].T + m.b[i]) for i in range(3))
        bias = torch.zeros(7, 7, dtype=torch.float64).masked_fill(~causal, float("-inf"))
        want = m.proj(merged(_sdpa(q, k, v, bias)))
        assert torch.allclose(m(x, bias), want, atol=1e-10)
        for bug in ("kv_swapped", "scale_none", "merge"):
            assert _changed(planted(styles.StackedLinear, m, bug, x, bias), want)

        m = styles.MhaInvertedMask().double().eval()
        a = m.self_attn
        w, b = a.in_proj_weight, a.in_proj_bias
        q, k, v = (heads(_rows(w, b, 32 * i, 32 * i + 32)(x)) for i in range(3))
        allowed = causal & padding  # [n_batch, 1, n_Q, n_K]
        want = a.out_proj(merged(_sdpa(q, k, v, allowed)))
        assert torch.allclose(m(x, causal, ~_keep()), want, atol=1e-10)
        per_sequence = padding.expand(2, 4, 7, 7).reshape(8, 7, 7)  # [n_batch·n_head, n_Q, n_K], as trace gives it
        assert torch.allclose(m(x, per_sequence), a.out_proj(merged(_sdpa(q, k, v, padding))), atol=1e-10)
        assert _changed(planted(styles.MhaInvertedMask, m, "on_queries", x, per_sequence),
                        a.out_proj(merged(_sdpa(q, k, v, padding))))

        m = styles.FunctionalMha().double().eval()
        w, b = m.in_proj_weight, m.in_proj_bias
        q, k, v = (heads(_rows(w, b, 32 * i, 32 * i + 32)(x)) for i in range(3))
        want = m.out_proj(merged(_sdpa(q, k, v, causal)))
        assert torch.allclose(m(x, causal), want, atol=1e-10)
        assert _changed(planted(styles.FunctionalMha, m, "polarity", x, causal), want)


@pytest.fixture(scope="module")
def padding(tmp_path_factory):
    path = tmp_path_factory.mktemp("pad") / "pad.npy"
    np.save(path, _keep().numpy())
    return str(path)


def _args(rule, padding):
    pad = ["--mask", padding, "--batch", "2"]
    return {"none": [], "causal": ["--causal"], "padding": pad, "both": ["--causal", *pad]}[rule]


CORRECT = [(name, rule) for name in ("TimeFirstInProjection", "PackedProjection", "SplitGqaWeight", "StackedEinsum",
                                     "StackedLinear", "FunctionalMha") for rule in ("none", "causal", "padding")] + \
    [("ViewUnbind", "none"), ("ViewUnbind", "padding"), ("MhaInvertedMask", "causal"),
     ("MhaInvertedMask", "padding"), ("MhaInvertedMask", "both")]


@pytest.mark.parametrize(("name", "rule"), CORRECT, ids=case_ids(CORRECT))
def test_correct_code_passes(runner, padding, name, rule):
    code, out = run_case(runner, STYLES, name, options=_args(rule, padding))
    assert_passes(code, out)


@pytest.mark.parametrize("name", ["TimeFirstInProjection", "SplitGqaWeight", "StackedEinsum", "StackedLinear"])
def test_each_cut_of_the_packed_weight_is_a_projection_of_its_own(runner, name):
    """The reference holds the rows each cut holds, its role read from the code's data flow."""
    code, out = run_case(runner, STYLES, name, options=["--causal"])
    assert_passes(code, out)
    held = {"TimeFirstInProjection": "q=in_proj_weight[0:32], k=in_proj_weight[32:64], v=in_proj_weight[64:96]",
            "SplitGqaWeight": "q=qkv[0:32], k=qkv[32:48], v=qkv[48:64]",
            "StackedEinsum": "q=qkv_kernel[0], k=qkv_kernel[1], v=qkv_kernel[2]",
            "StackedLinear": "q=w[0], k=w[1], v=w[2]"}[name]
    assert held in " ".join(out["reference"].split()), out["reference"]


def test_a_mask_per_sequence_goes_to_mha_as_one_per_sequence_and_head(runner, padding):
    code, out = run_case(runner, STYLES, "MhaInvertedMask", options=_args("padding", padding))
    assert_passes(code, out)
    assert any(n.startswith("mask: your code raised on a [.., n_Q, n_K] mask and runs on one shaped "
                            "[n_batch·n_head, n_Q, n_K]") for n in out["notes"]), out["notes"]


PLANTS = [("TimeFirstInProjection", "causal", "kv_swapped", "kv.swapped"),
          ("TimeFirstInProjection", "causal", "polarity", "mask.polarity"),
          ("TimeFirstInProjection", "padding", "scale_none", "scale.none"),
          ("PackedProjection", "causal", "kv_swapped", "kv.swapped"),
          ("PackedProjection", "none", "scale_d_head", "scale.d_head"),
          ("PackedProjection", "causal", "merge", "heads.merge_without_transpose"),
          ("SplitGqaWeight", "causal", "kv_swapped", "kv.swapped"),
          ("SplitGqaWeight", "causal", "tiled", "gqa.tiled"),
          ("SplitGqaWeight", "causal", "polarity", "mask.polarity"),
          ("StackedEinsum", "causal", "kv_swapped", "kv.swapped"),
          ("StackedEinsum", "causal", "scale_twice", "scale.twice"),
          ("StackedEinsum", "causal", "softmax_axis", "softmax.axis"),
          ("ViewUnbind", "padding", "kv_swapped", "kv.swapped"),
          ("ViewUnbind", "padding", "polarity", "mask.polarity"),
          ("StackedLinear", "causal", "kv_swapped", "kv.swapped"),
          ("StackedLinear", "causal", "scale_none", "scale.none"),
          ("StackedLinear", "causal", "merge", "heads.merge_without_transpose"),
          ("MhaInvertedMask", "padding", "on_queries", "mask.on_queries"),
          ("FunctionalMha", "causal", "polarity", "mask.polarity"),
          ("FunctionalMha", "padding", "polarity", "mask.polarity")]


@pytest.mark.parametrize(("name", "rule", "bug", "cause"), PLANTS, ids=case_ids(PLANTS))
def test_plants_are_named_by_experiment(runner, padding, name, rule, bug, cause):
    code, out = run_case(runner, STYLES, name, f"bug='{bug}'", _args(rule, padding))
    assert_named(code, out, cause)
