"""`attnscope trace` on what held-out round 45 found. A forward with a second mask-named parameter it never reads
(a Kosmos-2 port's `layer_head_mask`, kept in its signature) was handed the causal rule there under --causal and a
--mask key-padding file, beside the padding its `attention_mask` took: the rule was lost, and correct code was told
"only the key padding is applied". The rule now goes to another mask parameter only where the code reads it
(trace_mask._rule_beside, masking.reads), else the one mask parameter takes the two together. Checked against
F.scaled_dot_product_attention in float64, with the merged heads' LayerNorm."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case, saved

HERE = Path(__file__).resolve().parent
STYLES = str(HERE / "trace_styles_round45.py")
styles = user_module(STYLES)
B, N, D, H = 2, 9, 32, 4


def _keep() -> torch.Tensor:
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, 6:] = False
    return keep


@pytest.mark.parametrize("bug", [None, "scaled_twice"])
def test_the_style_is_sdpa_and_the_plant_changes_it(bug):
    m = styles.KosmosLike().double()
    x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(45), dtype=torch.float64)
    allowed = _keep()[:, None, None, :] & torch.ones(N, N, dtype=torch.bool).tril()
    q, k, v = (m._shape(p(x)) for p in (m.q_proj, m.k_proj, m.v_proj))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).reshape(B, N, D)
    want = m.out_proj(m.inner_attn_ln(o))
    additive = torch.zeros(B, 1, N, N, dtype=torch.float64).masked_fill(~allowed, -torch.inf)
    with torch.no_grad():
        got = styles.KosmosLike(bug=bug).double()(x, attention_mask=additive)[0]
        assert (got - want).abs().max() < 1e-10 if bug is None else (got - want).abs().max() > 1e-3


@pytest.fixture()
def options(tmp_path):
    return ("--causal", "--batch", str(B), "--nq", str(N), "--mask", saved(tmp_path, "pad.npy", _keep()))


def test_an_unread_mask_parameter_is_given_no_part_of_the_mask(runner, options):
    code, out = run_case(runner, STYLES, "KosmosLike", None, options)
    assert_passes(code, out)
    assert not any(n.startswith("layer_head_mask: given the causal rule") for n in out["notes"]), out["notes"]


def test_the_plant_is_named(runner, options):
    assert_named(*run_case(runner, STYLES, "KosmosLike", "bug='scaled_twice'", options), "scale.twice")
