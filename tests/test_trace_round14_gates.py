"""`attnscope trace` on attention with an output gate (round 14a's OpenFold `o * sigmoid(linear_g(q_x))`): the
merged heads (or each head's output) multiplied by a factor computed from the input, before the output projection,
read from the data flow as a convention (a note, exit 0), the reference gating with the code's own gate; mistakes
before the gate named by experiment. Styles of its own (tests/trace_styles_round14_gates.py): AlphaFold's einsum
GatingAttention, Qwen3-Next's gate from the query projection's extra half, a headwise gate before the merge, a SiLU
gate after it; each checked against F.scaled_dot_product_attention in float64, each plant shown to change it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from trace_round14_helpers import heads as _heads
from trace_round14_helpers import merged as _merged
from trace_round14_helpers import moved
from trace_round14_helpers import planted as _planted

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round14_gates.py")
styles = user_module(STYLES)


def test_the_styles_are_gated_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x, m = (torch.randn(2, n, 32, generator=g, dtype=torch.float64) for n in (5, 6))
    with torch.no_grad():
        af = moved(styles.GatingAttention(), 3)
        o = _merged(F.scaled_dot_product_attention(_heads(af.linear_q(x)), _heads(af.linear_k(m)),
                                                   _heads(af.linear_v(m))))
        want = af.output_linear(o * torch.sigmoid(af.gating_linear(x)))
        assert torch.allclose(af(x, m), want, atol=1e-10)
        for bug in ("scale_twice", "kv_swapped"):
            assert (_planted(styles.GatingAttention, af, bug, x, m) - want).abs().max() > 1e-2

        qg = moved(styles.QueryGated(), 3)
        qa, gate = qg.q_proj(x).unflatten(-1, (4, 2, 8)).unbind(-2)  # each head's queries, then its gate
        o = _merged(F.scaled_dot_product_attention(qa.transpose(1, 2), _heads(qg.k_proj(x)), _heads(qg.v_proj(x))))
        want = qg.o_proj(o * torch.sigmoid(gate.flatten(-2)))
        assert torch.allclose(qg(x), want, atol=1e-10)
        for bug in ("scale_none", "merge_no_transpose"):
            assert (_planted(styles.QueryGated, qg, bug, x) - want).abs().max() > 1e-2

        hw = moved(styles.HeadwiseGate(), 3)
        q, k, v = hw.qkv(x).chunk(3, -1)
        o = F.scaled_dot_product_attention(_heads(q), _heads(k), _heads(v))
        want = hw.proj(_merged(o * torch.sigmoid(hw.gate(x)).transpose(1, 2)[..., None]))
        assert torch.allclose(hw(x), want, atol=1e-10)
        for bug in ("scale_twice", "merge_no_transpose"):
            assert (_planted(styles.HeadwiseGate, hw, bug, x) - want).abs().max() > 1e-2

        sg = moved(styles.SiluGated(), 3)
        o = _merged(F.scaled_dot_product_attention(_heads(sg.to_q(x)), _heads(sg.to_k(x)), _heads(sg.to_v(x))))
        want = sg.to_out(o * F.silu(sg.to_gates(x)))
        assert torch.allclose(sg(x), want, atol=1e-10)
        assert (_planted(styles.SiluGated, sg, "kv_swapped", x) - want).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["GatingAttention", "QueryGated", "HeadwiseGate", "SiluGated"])
def test_an_output_gate_is_read_as_a_convention(runner, name):
    result, out = trace(runner, f"{STYLES}:{name}")
    assert result.exit_code == 0, result.stdout + result.stderr
    said = [n for n in out["notes"] if n.startswith("your code gates its attention's output (line ")]
    assert said and said[0].endswith("a convention, not a mistake"), out["notes"]
    statuses = {row["reference"]: row["status"] for row in out["alignment"]}
    assert statuses["x_gated"] in ("equal", "permuted") and statuses["x"] == "equal", statuses
    if name == "QueryGated":  # the queries are half of q_proj's rows, the gate the other half
        assert any(n.startswith("q_proj writes 64 features, of which your q reads 32 (q_proj[0:8, 16:24, 32:40, "
                                "48:56])") for n in out["notes"]), out["notes"]


@pytest.mark.parametrize(("name", "bug", "cause"), [
    ("GatingAttention", "scale_twice", "scale.twice"),
    ("GatingAttention", "kv_swapped", "kv.swapped"),
    ("QueryGated", "scale_none", "scale.none"),
    ("QueryGated", "merge_no_transpose", "heads.merge_without_transpose"),
    ("HeadwiseGate", "scale_twice", "scale.twice"),
    ("HeadwiseGate", "merge_no_transpose", "heads.merge_without_transpose"),
    ("SiluGated", "kv_swapped", "kv.swapped"),
])
def test_mistakes_before_the_gate_are_named_by_experiment(runner, name, bug, cause):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]
