"""`attnscope trace` on code that does arithmetic on its mask, 0/1 floats with 1 = present (round 14a's OpenFold
callers, `inf * (mask - 1)`, refused with 'your code raised' on trace's boolean): the kind read from the code's
use, a boolean that makes it raise in arithmetic retried as 0/1 floats and kept so. Styles of its own
(tests/trace_styles_round14_floatmask.py): OpenFold's bias list, the old TensorFlow multiplicative form, a function
with `(mask - 1.0) * 1e4`; each checked against F.scaled_dot_product_attention in float64, each plant shown to
change it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from trace_round14_helpers import heads as _heads
from trace_round14_helpers import merged as _merged
from trace_round14_helpers import moved, padding_file

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round14_floatmask.py")
styles = user_module(STYLES)


def test_the_styles_are_sdpa_with_key_padding_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 4:] = False
    ones = keep.double()  # 1 = present
    attend = keep[:, None, None, :]
    with torch.no_grad():
        pb = moved(styles.PairBiasAttention(), 7)
        want = pb.linear_o(_merged(F.scaled_dot_product_attention(
            _heads(pb.linear_q(x)), _heads(pb.linear_k(x)), _heads(pb.linear_v(x)), attn_mask=attend)))
        assert torch.allclose(pb(x, ones), want, atol=1e-8)
        wrong = styles.PairBiasAttention(bug="scale_none").double().eval()
        wrong.load_state_dict(pb.state_dict())
        assert (wrong(x, ones) - want).abs().max() > 1e-2

        mm = moved(styles.MultiplicativeMask(), 7)
        want = mm.dense(_merged(F.scaled_dot_product_attention(_heads(mm.wq(x)), _heads(mm.wk(x)), _heads(mm.wv(x)),
                                                               attn_mask=attend)))
        assert torch.allclose(mm(x, ones[:, None, None, :]), want, atol=1e-8)
        wrong = styles.MultiplicativeMask(bug="kv_swapped").double().eval()
        wrong.load_state_dict(mm.state_dict())
        assert (wrong(x, ones[:, None, None, :]) - want).abs().max() > 1e-2

        q, k, v = (torch.randn(2, 4, 7, 8, generator=g, dtype=torch.float64) for _ in range(3))
        assert torch.allclose(styles.masked_attention(q, k, v, ones[:, None, None, :]),
                              F.scaled_dot_product_attention(q, k, v, attn_mask=attend), atol=1e-8)


@pytest.fixture(scope="module")
def pad(tmp_path_factory):
    return padding_file(tmp_path_factory.mktemp("r14f"), 4)


@pytest.mark.parametrize(("name", "line"), [
    ("PairBiasAttention", "float 0/1, 1 = may attend: your code builds its own bias from the mask's numbers (line "),
    ("MultiplicativeMask", "float 0/1, 1 = may attend, as your code reads it: it computes with the mask as numbers"),
    ("masked_attention", "float 0/1, 1 = may attend, as your code reads it: it computes with the mask as numbers"),
])
def test_a_mask_the_code_does_arithmetic_on_is_given_as_0_1_floats(runner, pad, name, line):
    result, out = trace(runner, f"{STYLES}:{name}", "--mask", pad, "--batch", "2", "--nq", "7")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any(n.startswith(f"mask: {line}") for n in out["notes"]), out["notes"]


@pytest.mark.parametrize(("name", "bug", "cause"), [
    ("PairBiasAttention", "scale_none", "scale.none"),
    ("MultiplicativeMask", "kv_swapped", "kv.swapped"),
])
def test_mistakes_beside_a_0_1_mask_are_named_by_experiment(runner, pad, name, bug, cause):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug='{bug}'", "--mask", pad, "--batch", "2",
                        "--nq", "7")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]
