"""`attnscope trace` on what the forward's other parameters are given (round 20's feeds): RoPE's whole table in
one parameter in a form other than its name says, read from the code's run on each form trace knows (a complex
table for each sequence or one for all, the pair (cos, sin)); and the values made by the key projection where the
keys and values come from inputs of their own (kv.values_from_keys on value · W_kᵀ + b_k). Styles of its own
(tests/trace_styles_round20_feeds.py), each checked against F.scaled_dot_product_attention in float64, each plant
shown to change its output and named by experiment.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from trace_round14_helpers import heads, merged, padding_file, planted
from tracecases import assert_named, assert_passes, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round20_feeds.py")
styles = user_module(STYLES)


def _angles(n, d, base=10000.0):
    return torch.outer(torch.arange(n, dtype=torch.float64),
                       1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))  # [n, d / 2]


def _neighbours(x):
    """x [b, h, n, d], neighbours (2i, 2i + 1) turned by position · inv_freq."""
    theta = _angles(x.shape[-2], x.shape[-1])
    z = torch.complex(x[..., 0::2], x[..., 1::2]) * torch.polar(torch.ones_like(theta), theta)
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2)


def _halves(x):
    d = x.shape[-1]
    theta = _angles(x.shape[-2], d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * torch.polar(torch.ones_like(theta), theta)
    return torch.cat((z.real, z.imag), dim=-1)


def _changed(cls, m, want, args, bugs):
    for bug in bugs:
        assert (planted(cls, m, bug, *args) - want).abs().max() > 1e-2, bug


def test_the_rope_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    theta = _angles(7, 8)
    table = torch.polar(torch.ones_like(theta), theta)  # [n, d / 2]
    with torch.no_grad():
        m = styles.ComplexPerSequence().double().eval()
        q, k, v = heads(m.q_proj(x)), heads(m.k_proj(x), 2), heads(m.v_proj(x), 2)
        out = F.scaled_dot_product_attention(_neighbours(q), _neighbours(k).repeat_interleave(2, 1),
                                             v.repeat_interleave(2, 1), is_causal=True)
        want = m.o_proj(merged(out))
        batched = table.expand(2, 7, 4)
        # the module turns in float32 (view_as_complex of .float()), as Llama 4's does
        assert torch.allclose(m(x, batched), want, atol=1e-5)
        _changed(styles.ComplexPerSequence, m, want, (x, batched), ("kv_swapped", "scale_none"))

        a = styles.ComplexForAll().double().eval()
        q, k, v = heads(a.wq(x)), heads(a.wk(x)), heads(a.wv(x))
        want = a.wo(merged(F.scaled_dot_product_attention(_neighbours(q), _neighbours(k), v, is_causal=True)))
        assert torch.allclose(a(x, table), want, atol=1e-5)
        _changed(styles.ComplexForAll, a, want, (x, table), ("kv_swapped",))

        p = styles.PairUnderFreqsCis().double().eval()
        q, k, v = (heads(t) for t in p.qkv(x).chunk(3, dim=-1))
        want = p.proj(merged(F.scaled_dot_product_attention(_halves(q), _halves(k), v, is_causal=True)))
        cos, sin = torch.cat((theta, theta), -1).cos(), torch.cat((theta, theta), -1).sin()
        pair = (cos.expand(2, 7, 8), sin.expand(2, 7, 8))
        assert torch.allclose(p(x, pair), want, atol=1e-10)
        _changed(styles.PairUnderFreqsCis, p, want, (x, pair), ("scale_none",))


ROPE = ("--causal", "--rope")
ROPE_CORRECT = ["ComplexPerSequence", "ComplexForAll", "PairUnderFreqsCis"]


@pytest.mark.parametrize("target", ROPE_CORRECT)
def test_a_table_in_another_form_than_its_name_says_passes(runner, target):
    code, out = run_case(runner, STYLES, target, None, ROPE)
    assert_passes(code, out)
    said = [n for n in out["notes"] if n.startswith("RoPE's table (")]
    assert said and "read from its run" in said[0], out["notes"]


def test_the_form_read_is_said(runner):
    code, out = run_case(runner, STYLES, "ComplexPerSequence", None, ROPE)
    assert_passes(code, out)
    assert any("complex table" in n and "[n_batch, n_Q, d_head / 2]" in n and "no attribute" in n
               for n in out["notes"]), out["notes"]
    code, out = run_case(runner, STYLES, "PairUnderFreqsCis", None, ROPE)
    assert any("the pair (cos, sin)" in n for n in out["notes"]), out["notes"]


def test_an_asked_pairing_is_checked_on_a_complex_table(runner):
    # the complex table leaves the pairing to the code, unless --rope-pairing asks for one
    code, out = run_case(runner, STYLES, "ComplexPerSequence", None, (*ROPE, "--rope-pairing", "half-split"))
    assert_named(code, out, "rope.pairing")


ROPE_PLANTS = [("ComplexPerSequence", "bug='kv_swapped'", "kv.swapped"),
               ("ComplexPerSequence", "bug='scale_none'", "scale.none"),
               ("ComplexForAll", "bug='kv_swapped'", "kv.swapped"),
               ("PairUnderFreqsCis", "bug='scale_none'", "scale.none")]


test_rope_plants_are_named_by_experiment = plants_test(STYLES, [(target, init, ROPE, entry)
                                                                for target, init, entry in ROPE_PLANTS])


def test_the_kv_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(1)
    xq, xk, xv = (torch.randn(2, n, 32, generator=g, dtype=torch.float64) for n in (6, 9, 9))
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[0, 6:] = False
    with torch.no_grad():
        m = styles.DistilLike().double().eval()
        out = F.scaled_dot_product_attention(heads(m.q_lin(xq)), heads(m.k_lin(xk)), heads(m.v_lin(xv)),
                                             attn_mask=keep[:, None, None, :])
        want = m.out_lin(merged(out))
        assert torch.allclose(m(xq, xk, xv, keep.long()), want, atol=1e-10)
        _changed(styles.DistilLike, m, want, (xq, xk, xv, keep.long()), ("values_from_keys",) + INPUTS)

        c = styles.BartLikeCross().double().eval()
        want = c.out_proj(merged(F.scaled_dot_product_attention(heads(c.q_proj(xq)), heads(c.k_proj(xk)),
                                                                heads(c.v_proj(xv)))))
        assert torch.allclose(c(xq, xk, xv), want, atol=1e-10)
        _changed(styles.BartLikeCross, c, want, (xq, xk, xv), ("values_from_keys",) + INPUTS)

        lq = styles.LinearQKV().double().eval()
        want = lq.to_out(merged(F.scaled_dot_product_attention(heads(lq.to_q(xq)), heads(lq.to_k(xk)),
                                                               heads(lq.to_v(xv)))))
        assert torch.allclose(lq(xq, xk, xv), want, atol=1e-10)
        _changed(styles.LinearQKV, lq, want, (xq, xk, xv), ("values_from_keys",) + INPUTS)


def _kv_options(tmp_path, target):
    if target == "DistilLike":
        return ("--batch", "2", "--nq", "7", "--nk", "7", "--mask", padding_file(tmp_path, 5))
    return ("--batch", "2", "--nq", "6", "--nk", "9")


KV = ["DistilLike", "BartLikeCross", "LinearQKV"]
# round 33: each projection right, fed the other's input (`self.k_proj(value)`), and the entry and words that say it
INPUT_PLANTS = {"inputs_swapped": ("kv.swapped", "keys and values swapped at their inputs"),
                "keys_from_value": ("kv.keys_from_values", "the keys made from the value input"),
                "values_from_key": ("kv.values_from_keys", "the values made from the key input")}
INPUTS = tuple(INPUT_PLANTS)


@pytest.mark.parametrize("target", KV)
def test_the_kv_styles_pass(runner, tmp_path, target):
    assert_passes(*run_case(runner, STYLES, target, None, _kv_options(tmp_path, target)))


@pytest.mark.parametrize("target", KV)
def test_values_made_by_the_key_projection_are_named(runner, tmp_path, target):
    code, out = run_case(runner, STYLES, target, "bug='values_from_keys'", _kv_options(tmp_path, target))
    found = assert_named(code, out, "kv.values_from_keys")
    said = found["diagnosis"]
    assert "the values made by the key projection" in said and "value input through" in said, found


@pytest.mark.parametrize("bug", INPUTS)
@pytest.mark.parametrize("target", KV)
def test_a_projection_fed_the_other_input_is_named(runner, tmp_path, target, bug):
    """`self.k_proj(value)`, `self.v_proj(key)` or both, in three styles: named by the experiment that feeds the
    reference's own projection the other input, where the keys and values come from inputs of their own."""
    code, out = run_case(runner, STYLES, target, f"bug='{bug}'", _kv_options(tmp_path, target))
    entry, words = INPUT_PLANTS[bug]
    found = assert_named(code, out, entry)
    assert words in found["diagnosis"], found
