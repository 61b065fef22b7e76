"""`attnscope trace` on a second required tensor the code never projects and never combines with its scores
(maskroles.with_residuals): a residual added to what the module returns is handed a random tensor shaped as the input,
and the ops after the output projection are replayed on the reference's (aftermerge.py); a tensor added to the input
before its projections is the input's position embedding, whatever its name. Neither is read as the mask (which they
were: any `+` counted as a mask's use) nor as a cross-attention's memory. A memory projected on its own stays one.
Each style checked against float64 F.scaled_dot_product_attention, each plant shown to change its output."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from trace_round14_helpers import heads, merged
from trace_round14_helpers import planted as _planted
from tracecases import assert_passes, passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round28_residual.py")
styles = user_module(STYLES)


def _sdpa(q, k, v, mask=None):
    return merged(F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=mask))


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(2, 7, 32, generator=g, dtype=torch.float64) for _ in range(2))
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    additive = torch.zeros(7, 7, dtype=torch.float64).masked_fill(~causal, float("-inf"))
    with torch.no_grad():
        s = styles.ShortcutBlock().double().eval()
        want = r + s.proj(_sdpa(s.q(x), s.k(x), s.v(x), causal))
        assert torch.allclose(s(x, r, additive), want, atol=1e-10)
        assert (_planted(styles.ShortcutBlock, s, "no_scale", x, r, additive) - want).abs().max() > 1e-2
        rr = styles.ReturnedResidual().double().eval()
        want = rr.o(_sdpa(rr.q(x), rr.k(x), rr.v(x))) + r
        assert torch.allclose(rr(x, r), want, atol=1e-10)
        assert (_planted(styles.ReturnedResidual, rr, "kv_swapped", x, r) - want).abs().max() > 1e-2
        qe = styles.QueryEmbed().double().eval()
        want = qe.proj(_sdpa(qe.q(x + r), qe.k(x + r), qe.v(x)))
        assert torch.allclose(qe(x, r), want, atol=1e-10)
        assert (_planted(styles.QueryEmbed, qe, "softmax_axis", x, r) - want).abs().max() > 1e-2
        sl = styles.SoftmaxLayer().double().eval()
        assert torch.allclose(sl(x, additive), sl.proj(_sdpa(sl.q(x), sl.k(x), sl.v(x), causal)), atol=1e-10)
        mp = styles.MemoryPlusPos().double().eval()
        m, p = (torch.randn(2, 9, 32, generator=g, dtype=torch.float64) for _ in range(2))
        assert torch.allclose(mp(x, m, p), mp.proj(_sdpa(mp.q(x), mp.k(m + p), mp.v(m))), atol=1e-10)


CORRECT = [("ShortcutBlock", None, ("--causal",)), ("ShortcutBlock", None, ()), ("ReturnedResidual", None, ()),
           ("QueryEmbed", None, ()), ("SoftmaxLayer", None, ("--causal",))]

test_correct_styles_pass = passing_test(STYLES, CORRECT)

PLANTED = [("ShortcutBlock", "bug='no_scale'", ("--causal",), "scale.none"),
           ("ReturnedResidual", "bug='kv_swapped'", (), "kv.swapped"),
           ("QueryEmbed", "bug='softmax_axis'", (), "softmax.axis")]

test_planted_bugs_are_named_by_experiment = plants_test(STYLES, PLANTED)


def test_the_residual_is_no_mask_and_no_memory(runner):
    """The note says what the tensor was read as; the mask is the one the code adds to its scores; self-attention,
    n_K = n_Q, the return compared end to end."""
    code, out = run_case(runner, STYLES, "ShortcutBlock", None, ("--causal",))
    assert_passes(code, out)
    notes = " ".join(out["notes"])
    assert "shortcut: your code only combines it with what it returns" in notes, notes
    assert "attn_mask: additive float" in notes and "compared end to end" in notes, notes
    assert out["params"]["sizes"]["n_K"] == out["params"]["sizes"]["n_Q"]
    code, out = run_case(runner, STYLES, "QueryEmbed")
    assert_passes(code, out)
    assert any("query_embed: your code adds it to tgt" in n for n in out["notes"]), out["notes"]


def test_a_memory_projected_alone_stays_the_memory(runner):
    """DETR's cross-attention: `memory` reaches v_proj alone, so it is the keys' and values' input, n_K its own."""
    code, out = run_case(runner, STYLES, "MemoryPlusPos", None, ("--nk", "9"))
    assert_passes(code, out)
    assert out["params"]["sizes"]["n_K"] == 9, out["params"]["sizes"]
    assert not any("read as a residual" in n or "read as a position embedding, given" in n for n in out["notes"])


def _helper_add(scores, bias):
    return scores + bias


def _scores_through_helper(x, bias):
    return _helper_add(x @ x.transpose(-1, -2), bias).softmax(-1) @ x


def _weights_scaled(x, keep):
    attn = (x @ x.transpose(-1, -2)).softmax(-1)
    return (attn * keep) @ x  # multiplied into the weights: a mask


def _output_scaled(x, gain):
    attn = (x @ x.transpose(-1, -2)).softmax(-1)
    return (attn @ x) * gain  # the output scaled, after the product with the values: no mask


def test_how_an_added_parameter_is_read():
    """The AST reading (offscores.py through maskroles.read): on the scores or the weights a mask; added to what is
    returned a residual; added to the input before a projection a position embedding; a helper's return goes back
    to its caller, which may take it to the scores (a mask, as before)."""
    from attnscope.usertrace import maskroles

    assert maskroles.read(styles.ShortcutBlock().forward, "shortcut") == {"residual"}
    assert maskroles.role(styles.ShortcutBlock().forward, "attn_mask") == "mask"
    assert maskroles.read(styles.ReturnedResidual().forward, "residual") == {"residual"}
    assert maskroles.read(styles.QueryEmbed().forward, "query_embed") == {"added"}
    assert "input" in maskroles.read(styles.MemoryPlusPos().forward, "memory")
    # a layer it cannot tell (no module at hand) may be a softmax: the sum stays on the scores
    assert maskroles.read(styles.QueryEmbed.forward, "query_embed") == {"mask"}
    # the module's nn.Softmax is a softmax, its nn.Dropout passes the value on (vit-pytorch's self.attend)
    assert maskroles.role(styles.SoftmaxLayer().forward, "bias") == "mask"
    assert maskroles.role(_scores_through_helper, "bias") == "mask"
    assert maskroles.role(_weights_scaled, "keep") == "mask"
    assert maskroles.role(_output_scaled, "gain") is None


def _rotated_keys(q, k, v):
    cos, sin = torch.ones(q.shape[-1]), torch.zeros(q.shape[-1])
    d = q.shape[-1]  # q read before it is rotated: another value, whose reads say nothing of the sum's
    q, k = q * cos + q.flip(-1) * sin, k * cos + k.flip(-1) * sin
    return F.scaled_dot_product_attention(q, k, v, scale=d ** -0.5)


def _angles_from_steps(x, step):
    inv = 1.0 / 10000.0 ** (torch.arange(0, x.shape[-1], 2) / x.shape[-1])
    angles = step.float()[..., None] * inv
    cos = angles.cos().repeat_interleave(2, dim=-1)

    def turn(u):
        return u * cos

    q = turn(x)
    return (q @ x.transpose(-1, -2)).softmax(-1) @ x


def test_rotated_inputs_and_positions_are_no_masks():
    """Keys rotated by RoPE's tables and handed to SDPA as its key (round 24's ntk_attention), and steps made into
    RoPE's angles (round 25's StepRotaryAttention), were read as masks since 5b58727: neither is."""
    from attnscope.usertrace import maskroles

    assert maskroles.role(_rotated_keys, "k") is None and "added" in maskroles.read(_rotated_keys, "k")
    assert maskroles.read(_angles_from_steps, "step") == {"angles"}
    assert maskroles.role(_angles_from_steps, "step") is None
