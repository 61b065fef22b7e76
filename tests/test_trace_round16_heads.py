"""`attnscope trace` on heads and projections in the forms students and papers write them (round 16's heads): heads
computed one at a time and concatenated, with or without an output projection (compared up to the merge where there
is none, of any width); one projection every head shares, applied after the split (held block-diagonal, a note); a
projection computed and thrown away, which never makes the one that took its role a fused one. Styles of its own
(tests/trace_styles_round16_heads.py), each checked against F.scaled_dot_product_attention in float64 and each plant
shown to change its output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from trace_round14_helpers import heads as _heads
from trace_round14_helpers import merged as _merged
from trace_round14_helpers import planted as _planted

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round16_heads.py")
styles = user_module(STYLES)


def _sdpa(q, k, v, h=4, causal=False):
    return _merged(F.scaled_dot_product_attention(_heads(q, h), _heads(k, h), _heads(v, h), is_causal=causal))


def _stacked(layers):
    return torch.cat([layer.weight for layer in layers]), torch.cat([layer.bias for layer in layers]) \
        if layers[0].bias is not None else None


def test_heads_one_at_a_time_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        wr = styles.CausalHeadsWrapper().double().eval()
        q, k, v = (F.linear(x, *_stacked([getattr(h, n) for h in wr.heads])) for n in ("W_query", "W_key", "W_value"))
        want = _sdpa(q, k, v, causal=True)  # [2, 6, 24]: no output projection, 4 heads of 6
        assert want.shape[-1] == 24 and torch.allclose(wr(x), want, atol=1e-10)
        for bug in ("scale_d_in", "softmax_dim1"):
            assert (_planted(styles.CausalHeadsWrapper, wr, bug, x) - want).abs().max() > 1e-2

        for proj in (True, False):
            hl = styles.HeadList(proj=proj).double().eval()
            q, k, v = (F.linear(x, _stacked([getattr(h, n) for h in hl.heads])[0]) for n in ("query", "key", "value"))
            merged = _sdpa(q, k, v, causal=True)
            want = hl.proj(merged) if proj else merged
            assert torch.allclose(hl(x), want, atol=1e-10)
            for bug in ("scale_C", "mask_after", "values_from_keys"):
                assert (_planted(styles.HeadList, hl, bug, x, proj=proj) - want).abs().max() > 1e-2

        wl = styles.WeightList().double().eval()
        q, k, v = (x @ torch.cat(list(ws), dim=1) for ws in (wl.W_q, wl.W_k, wl.W_v))
        want = _sdpa(q, k, v)
        assert torch.allclose(wl(x), want, atol=1e-10)
        for bug in ("kv_swapped", "scale_none", "merge_no_transpose"):
            assert (_planted(styles.WeightList, wl, bug, x) - want).abs().max() > 1e-2


def test_a_projection_every_head_shares_is_block_diagonal_sdpa():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        def blocks(weight):  # a head's [d_out, d_in] weight once per head, as a Linear of the whole width holds it
            return torch.block_diag(*[weight] * 4)

        sh = styles.SharedHeadLinear().double().eval()
        q, k, v = (F.linear(x, blocks(m.weight)) for m in (sh.queries, sh.keys, sh.values))
        want = sh.fc_out(_sdpa(q, k, v))
        assert torch.allclose(sh(x), want, atol=1e-10)
        for bug in ("kv_swapped", "softmax_dim2", "merge_no_transpose"):
            assert (_planted(styles.SharedHeadLinear, sh, bug, x) - want).abs().max() > 1e-2

        sf = styles.SharedHeadsFirst().double().eval()
        q, k, v = (F.linear(x, blocks(m.weight), m.bias.repeat(4)) for m in (sf.q, sf.k, sf.v))
        want = sf.o(_sdpa(q, k, v, causal=True))
        assert torch.allclose(sf(x), want, atol=1e-10)
        assert (_planted(styles.SharedHeadsFirst, sf, "scale_dim", x) - want).abs().max() > 1e-2

        se = styles.SharedEinsum().double().eval()
        q, k, v = (x @ blocks(w) for w in (se.w_q, se.w_k, se.w_v))  # x @ W: blocks of W, not of Wᵀ
        want = _sdpa(q, k, v) @ se.w_o
        assert torch.allclose(se(x), want, atol=1e-10)
        for bug in ("scale_none", "values_from_keys"):
            assert (_planted(styles.SharedEinsum, se, bug, x) - want).abs().max() > 1e-2

        be = styles.BlockEinsum().double().eval()
        q, k, v = (x @ torch.block_diag(*w) for w in (be.wq, be.wk, be.wv))
        want = _sdpa(q, k, v)  # no output projection
        assert torch.allclose(be(x), want, atol=1e-10)
        assert (_planted(styles.BlockEinsum, be, "kv_swapped", x) - want).abs().max() > 1e-2


def test_a_projection_thrown_away_is_no_part_of_the_attention():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 6, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        vt = styles.ValueThrownAway().double().eval()
        want = vt.fc(_sdpa(vt.Wq(x), vt.Wk(x), vt.Wv(x), causal=True))
        assert torch.allclose(vt(x), want, atol=1e-10)
        assert (_planted(styles.ValueThrownAway, vt, "values_from_keys", x) - want).abs().max() > 1e-2

        so = styles.SelfOnlyValueThrownAway().double().eval()
        want = _sdpa(so.query(x), so.key(x), so.value(x))
        assert torch.allclose(so(x), want, atol=1e-10)
        assert (_planted(styles.SelfOnlyValueThrownAway, so, "values_from_keys", x) - want).abs().max() > 1e-2

        pt = styles.ParamsThrownAway().double().eval()
        want = _sdpa(x @ pt.W_Q, x @ pt.W_K, x @ pt.W_V) @ pt.W_O
        assert torch.allclose(pt(x), want, atol=1e-10)
        assert (_planted(styles.ParamsThrownAway, pt, "values_from_keys", x) - want).abs().max() > 1e-2


CORRECT = [
    ("CausalHeadsWrapper", ["--causal"], "merge"),
    ("HeadList", ["--causal"], None),
    ("HeadList", ["--causal", "--init", "proj=False"], "merge"),
    ("WeightList", [], "merge"),
    ("SharedHeadLinear", [], "blocks"),
    ("SharedHeadsFirst", ["--causal"], "blocks"),
    ("SharedEinsum", [], "blocks"),
    ("BlockEinsum", [], "blocks"),
    ("ValueThrownAway", ["--causal"], None),
    ("SelfOnlyValueThrownAway", [], "merge"),
    ("ParamsThrownAway", [], None),
]


@pytest.mark.parametrize(("name", "flags", "said"), CORRECT)
def test_correct_heads_and_projections_pass(runner, name, flags, said):
    result, out = trace(runner, f"{STYLES}:{name}", *flags)
    assert result.exit_code == 0, result.stdout + result.stderr
    statuses = {row["reference"]: row["status"] for row in out["alignment"]}
    assert statuses["x"] == "equal", statuses
    if said == "merge":  # no output projection: compared up to the merge, whatever its width
        assert "your code has no output projection" in out["reference"], out["reference"]
        assert statuses["x_rsh2"] == "equal", statuses
    if said == "blocks":
        assert any("after the split" in n and "block-diagonal projection of the whole width (4 blocks, [32, 32])" in n
                   and n.endswith("a convention, not a mistake") for n in out["notes"]), out["notes"]


def test_heads_of_their_own_width_size_the_run(runner):
    """4 heads of 6 on a width of 32: d_head is what each head's projections write, not d_feat / n_head."""
    result, out = trace(runner, f"{STYLES}:CausalHeadsWrapper", "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["params"]["sizes"]["d_head"] == 6 and out["params"]["sizes"]["n_head"] == 4, out["params"]


PLANTS = [
    ("CausalHeadsWrapper", ["--causal"], "bug='scale_d_in'", "scale.d_model"),
    ("CausalHeadsWrapper", ["--causal"], "bug='softmax_dim1'", "softmax.axis"),
    ("HeadList", ["--causal"], "bug='scale_C'", "scale.d_model"),
    ("HeadList", ["--causal"], "bug='mask_after'", "mask.after_softmax"),
    ("HeadList", ["--causal"], "bug='values_from_keys'", "kv.values_from_keys"),
    ("HeadList", ["--causal"], "bug='scale_C', proj=False", "scale.d_model"),
    ("HeadList", ["--causal"], "bug='mask_after', proj=False", "mask.after_softmax"),
    ("HeadList", ["--causal"], "bug='values_from_keys', proj=False", "kv.values_from_keys"),
    ("WeightList", [], "bug='kv_swapped'", "kv.swapped"),
    ("WeightList", [], "bug='scale_none'", "scale.none"),
    ("WeightList", [], "bug='merge_no_transpose'", "heads.merge_without_transpose"),
    ("SharedHeadLinear", [], "bug='kv_swapped'", "kv.swapped"),
    ("SharedHeadLinear", [], "bug='softmax_dim2'", "softmax.axis"),
    ("SharedHeadLinear", [], "bug='merge_no_transpose'", "heads.merge_without_transpose"),
    ("SharedHeadsFirst", ["--causal"], "bug='scale_dim'", "scale.d_model"),
    ("SharedEinsum", [], "bug='scale_none'", "scale.none"),
    ("SharedEinsum", [], "bug='values_from_keys'", "kv.values_from_keys"),
    ("BlockEinsum", [], "bug='kv_swapped'", "kv.swapped"),
    ("ValueThrownAway", ["--causal"], "bug='values_from_keys'", "kv.values_from_keys"),
    ("SelfOnlyValueThrownAway", [], "bug='values_from_keys'", "kv.values_from_keys"),
    ("ParamsThrownAway", [], "bug='values_from_keys'", "kv.values_from_keys"),
]


@pytest.mark.parametrize(("name", "flags", "init", "cause"), PLANTS)
def test_mistakes_in_these_forms_are_named_by_experiment(runner, name, flags, init, cause):
    result, out = trace(runner, f"{STYLES}:{name}", *flags, "--init", init)
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == cause and first["evidence"].startswith("by experiment"), first
