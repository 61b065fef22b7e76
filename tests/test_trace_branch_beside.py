"""A Linear named like an output projection that reads the module's input, not what the attention made (ConvBERT's
`conv_out_layer`, held-out round 57): the reference is compared up to the merge of the heads, and its note says the
code has no output projection, where it used to call the layer a parallel block's (projections.merge_only,
flow.before_any_pattern). The style is checked against F.scaled_dot_product_attention in float64 first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from trace_styles_branch_beside import ConvBranchAttention
from tracecases import assert_named, assert_passes, run_case

STYLES = str(Path(__file__).parent / "trace_styles_branch_beside.py")


def test_the_attention_half_is_sdpa_and_each_plant_changes_it():
    torch.manual_seed(0)
    m = ConvBranchAttention().double().eval()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    heads = [getattr(m, n)(x).view(2, 5, 4, 4).transpose(1, 2) for n in ("query", "key", "value")]
    with torch.no_grad():
        want = F.scaled_dot_product_attention(*heads).transpose(1, 2)
        got = m(x).view(2, 5, 8, 4)
        assert (got[:, :, :4] - want).abs().max() < 1e-12
        for bug in ("scale_hidden", "softmax_axis", "merge_no_transpose"):
            planted = ConvBranchAttention(bug=bug).double().eval()
            planted.load_state_dict(m.state_dict())
            assert (planted(x) - m(x)).abs().max() > 1e-3, bug


def test_a_branch_beside_the_heads_is_no_output_projection(runner):
    code, out = run_case(runner, STYLES, "ConvBranchAttention", None, ("--nq", "5"))
    assert_passes(code, out)
    assert "your conv_out_layer reads 32 features, none of them made by the attention" in out["reference"], out
    assert "your code has no output projection" in out["reference"]


@pytest.mark.parametrize(("bug", "entry"), [("scale_hidden", "scale.d_model"), ("softmax_axis", "softmax.axis"),
                                            ("merge_no_transpose", "heads.merge_without_transpose")])
def test_plants_beside_the_branch_are_named(runner, bug, entry):
    assert_named(*run_case(runner, STYLES, "ConvBranchAttention", f"bug='{bug}'", ("--nq", "5")), entry)
