"""`attnscope trace` where a module's config and its own attribute say different shares of each head for RoPE to turn
(round 29's persimmon.rope_whole_head: `self.rotary_ndims = head_dim` while the config says partial_rotary_factor =
0.5). trace followed the attribute (it never read a transformers 5 config's rope_parameters) and exited 0. Now the
config's share (and base) is the reference's where the module's attribute says another, a note says which values
disagree, and code that rotates another share is rope.fraction by experiment (usertrace/declared.py). Styles of our
own (tests/trace_styles_round29_ropefraction.py), each checked against a float64 formula of partial RoPE and SDPA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round29_ropefraction.py")
styles = user_module(STYLES)

PERSIMMON = ("config=PersimmonConfig(hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.5, "
             "qk_layernorm=True)")
NEOX, PHI = "config=NeoXArgs()", "config=PhiArgs(rope_theta=500000.0)"
ROPE = ("--rope", "--causal")


def _partial_rope(x, rotary, base):
    """The first `rotary` coordinates of each head turned half-split at position t, base^(-2i / rotary)."""
    n = x.shape[-2]
    inv = 1.0 / base ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    turn, keep = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    turned = turn * cos + torch.cat((-turn[..., half:], turn[..., :half]), -1) * sin
    return torch.cat((turned, keep), -1)


def _attend(q, k, v, rotary, base, dense):
    q, k = _partial_rope(q, rotary, base), _partial_rope(k, rotary, base)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return dense(o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1))


def test_the_styles_are_partial_rope_and_sdpa():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 64, dtype=torch.float64)
    m = styles.FusedPerHead(styles.PersimmonConfig(hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.5,
                                                   qk_layernorm=True)).double()
    w = m.query_key_value.weight.view(4, 3, 16, 64)
    bias = m.query_key_value.bias.view(4, 3, 16)
    q, k, v = ((torch.einsum("btc,hdc->bhtd", x, w[:, i]) + bias[:, i][None, :, None]) for i in range(3))
    q = F.layer_norm(q, (16,), m.q_layernorm.weight, m.q_layernorm.bias)
    k = F.layer_norm(k, (16,), m.k_layernorm.weight, m.k_layernorm.bias)
    torch.testing.assert_close(m(x), _attend(q, k, v, 8, 10000.0, m.dense))

    m = styles.NeoXStyle(styles.NeoXArgs()).double()
    w, bias = m.query_key_value.weight.view(4, 3, 16, 64), m.query_key_value.bias.view(4, 3, 16)
    q, k, v = ((torch.einsum("btc,hdc->bhtd", x, w[:, i]) + bias[:, i][None, :, None]) for i in range(3))
    torch.testing.assert_close(m(x), _attend(q, k, v, 4, 10000.0, m.dense))

    m = styles.PhiStyle(styles.PhiArgs(rope_theta=500000.0)).double()
    q, k, v = (p(x).view(2, 7, 4, 16).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
    causal = torch.zeros(7, 7, dtype=torch.float64).masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), -1e30)
    torch.testing.assert_close(m(x, causal), _attend(q, k, v, 8, 500000.0, m.dense))

    m = styles.FixedHalf().double()
    q, k, v = m.qkv(x).view(2, 7, 3, 4, 16).permute(2, 0, 3, 1, 4)
    torch.testing.assert_close(m(x), _attend(q, k, v, 8, 10000.0, m.proj))

    m = styles.CappedCopy(styles.CapArgs()).double()
    q, k, v = m.qkv(x).view(2, 7, 3, 4, 16).permute(2, 0, 3, 1, 4)
    scores = 3.0 * torch.tanh(q @ k.transpose(-1, -2) / 4.0 / 3.0)
    scores = scores.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(m(x), m.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 7, 64)))


# FusedPerHead's 'whole_head' (round 29's case), PhiStyle's 'theta_attr' and CappedCopy's 'cap_attr' are named in the
# tests of their notes below
PLANTS = [("FusedPerHead", f"{PERSIMMON}, bug='narrow'", ROPE, "rope.fraction"),
          ("NeoXStyle", f"{NEOX}, bug='whole_head'", ROPE, "rope.fraction"),
          ("NeoXStyle", f"{NEOX}, bug='narrow'", ROPE, "rope.fraction"),
          ("NeoXStyle", "config=NeoXArgs(rotary_pct=1.0), bug='fixed_quarter'", ROPE, "rope.fraction"),
          ("PhiStyle", f"{PHI}, bug='whole_head'", ROPE, "rope.fraction"),
          ("PhiStyle", f"{PHI}, bug='narrow'", ROPE, "rope.fraction")]
CHANGED = [*PLANTS, ("FusedPerHead", f"{PERSIMMON}, bug='whole_head'", ROPE, ""),
           ("PhiStyle", f"{PHI}, bug='theta_attr'", ROPE, ""),
           ("CappedCopy", "config=CapArgs(), bug='cap_attr'", (), "")]
# FusedPerHead and FixedHalf pass in test_an_agreed_or_single_share_is_read_and_said
CORRECT = [("NeoXStyle", NEOX, ROPE), ("PhiStyle", PHI, ROPE), ("CappedCopy", "config=CapArgs()", ("--causal",))]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 64)
    causal = torch.zeros(7, 7).masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    for name, init, _, _ in CHANGED:
        config = eval(init.split("=", 1)[1].rsplit(", bug=", 1)[0], vars(styles))  # noqa: S307
        bug = init.rsplit("bug='", 1)[1].rstrip("'")
        good, bad = getattr(styles, name)(config), getattr(styles, name)(config, bug=bug)
        outs = [m(x, causal) if name == "PhiStyle" else m(x) for m in (good, bad)]
        assert (outs[0] - outs[1]).abs().max() > 1e-3, (name, bug)


test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


def _notes(out):
    return [" ".join(n.split()) for n in out["notes"]]


def test_the_disagreement_is_said(runner):
    code, out = run_case(runner, STYLES, "FusedPerHead", f"{PERSIMMON}, bug='whole_head'", ROPE)
    assert assert_named(code, out, "rope.fraction")["reference"] == "Q_rot", out["first_divergence"]
    said = [n for n in _notes(out) if n.startswith("RoPE's rotated share")]
    assert said and "(its config's partial_rotary_factor = 0.5)" in said[0] and "(its rotary_ndims = 16)" in said[0] \
        and "declared values that disagree" in said[0], _notes(out)


@pytest.mark.parametrize(("target", "init", "options", "entry", "words"), [
    ("PhiStyle", f"{PHI}, bug='theta_attr'", ROPE, "rope.base",
     "your module's config says RoPE base 500000 (its rope_theta) and the module itself says another (its rope_theta "
     "= 10000): declared values that disagree"),
    ("CappedCopy", "config=CapArgs(), bug='cap_attr'", ("--causal",), "softcap.value",
     "the module itself says another (its attn_logit_softcapping = 5): declared values that disagree")])
def test_other_declared_values_that_disagree_are_said(runner, target, init, options, entry, words):
    """The config's base (softcap) against the module's own attribute: the config's is the reference's, the code's
    deviation named by experiment, and the note says both (as for the rotated share)."""
    code, out = run_case(runner, STYLES, target, init, options)
    assert_named(code, out, entry)
    assert any(words in n for n in _notes(out)), _notes(out)


@pytest.mark.parametrize(("target", "init", "words"), [
    ("FusedPerHead", PERSIMMON, "(its config's partial_rotary_factor = 0.5)"),
    ("FixedHalf", None, "(its rotary_dim = 8)")])
def test_an_agreed_or_single_share_is_read_and_said(runner, target, init, words):
    code, out = run_case(runner, STYLES, target, init, ROPE)
    assert code == 0 and out["first_divergence"] is None, out["first_divergence"]
    assert any(n.startswith("RoPE: it rotates the first 8 of each head's 16") and words in n for n in _notes(out)), \
        _notes(out)
    assert not any("disagree" in n for n in _notes(out)), _notes(out)
