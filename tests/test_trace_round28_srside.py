"""`attnscope trace` where the keys' and values' input side passes through a layer of the module's own that makes
no role: PVT-v2's linear mode with a pointwise Conv1d (`sr`) after the pooling (k and v apart, or one fused kv), a
pooled memory through an nn.Linear of its own. Such a layer is on the input side (keyinputs.py), and the layers
nearest above the scores' operands are the roles' projections (flow._nearest), never one further up. Keys made from
the projected queries stay a mistake, no convention. Each style is checked against float64
F.scaled_dot_product_attention, each plant shown to change its output."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from trace_round14_helpers import heads, merged
from trace_round14_helpers import planted as _planted
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round28_srside.py")
styles = user_module(STYLES)


def _sdpa(q, k, v, h=4):
    return merged(F.scaled_dot_product_attention(heads(q, h), heads(k, h), heads(v, h)))


def _ln(m, x):
    return F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        for fused in (False, True):
            m = styles.PoolConvKV(fused=fused).double().eval()
            pooled = F.adaptive_avg_pool1d(x.transpose(1, 2), 5)
            side = F.gelu(_ln(m.norm, (m.sr.weight[:, :, 0] @ pooled + m.sr.bias[:, None]).transpose(1, 2)))
            if fused:  # view(B, -1, 2, h, d): the first half of kv's rows makes the keys, the second the values
                k, v = (side @ m.kv.weight.T + m.kv.bias).split(32, dim=-1)
            else:
                k, v = m.k(side), m.v(side)
            want = m.proj(_sdpa(m.q(x), k, v))
            assert torch.allclose(m(x), want, atol=1e-10)
            for bug in ("kv_swapped", "no_scale"):
                assert (_planted(styles.PoolConvKV, m, bug, x, fused=fused) - want).abs().max() > 1e-2, bug
        mem = styles.MemoryLinear().double().eval()
        side = torch.tanh(mem.mem(x.unflatten(1, (4, 2)).mean(2)))
        want = mem.o(_sdpa(mem.q(x), mem.k(side), mem.v(side)))
        assert torch.allclose(mem(x), want, atol=1e-10)
        assert (_planted(styles.MemoryLinear, mem, "softmax_axis", x) - want).abs().max() > 1e-2
        kq = styles.KeysFromQueries().double().eval()
        right = kq.o(_sdpa(kq.q(x), kq.k(x), kq.v(x)))
        assert (kq(x) - right).abs().max() > 1e-2


OPTIONS = ("--nq", "8")
CORRECT = [("PoolConvKV", None, OPTIONS), ("PoolConvKV", "fused=True", OPTIONS), ("MemoryLinear", None, OPTIONS)]

test_correct_styles_pass = passing_test(STYLES, CORRECT)

PLANTED = [("PoolConvKV", "bug='kv_swapped'", OPTIONS, "kv.swapped"),
           ("PoolConvKV", "fused=True, bug='no_scale'", OPTIONS, "scale.none"),
           ("PoolConvKV", "fused=True, bug='kv_swapped'", OPTIONS, "kv.swapped"),
           ("MemoryLinear", "bug='softmax_axis'", OPTIONS, "softmax.axis")]

test_planted_bugs_are_named_by_experiment = plants_test(STYLES, PLANTED)


def test_the_layer_on_the_input_side_is_no_projection(runner):
    """The pointwise sr and the memory's Linear are on the keys' input side, said in a note; the reference holds the
    roles' own projections (the fused kv cut in two), never sr or mem."""
    for target, init, layer in (("PoolConvKV", None, "sr"), ("PoolConvKV", "fused=True", "sr"),
                                ("MemoryLinear", None, "mem")):
        code, out = run_case(runner, STYLES, target, init, OPTIONS)
        assert code == 0, out["first_divergence"]
        assert f"={layer}" not in out["reference"] and f"{layer}," not in out["reference"], out["reference"]
        assert out["params"]["sizes"]["n_K"] == (5 if layer == "sr" else 4)
        assert any("input side" in note for note in out["notes"]), out["notes"]


def test_keys_from_the_projected_queries_stay_a_mistake(runner):
    """`self.k(q_feat)`: the query projection on the keys' way is a role's, so no input side is read and no
    convention said: the trace parts from the reference (exit 1)."""
    code, out = run_case(runner, STYLES, "KeysFromQueries", None, OPTIONS)
    assert code == 1 and out["first_divergence"] is not None, out
    assert not any("input side" in note for note in out["notes"]), out["notes"]
