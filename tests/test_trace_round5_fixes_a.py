"""`attnscope trace` on conventions a held-out round (round 4) found unread (tests/trace_styles_round5_a.py):

- a qk-norm's form read from the user's own norm by experiment (usertrace/normforms.py): Gemma's `(1 + w)` in
  float32, a LayerNorm written by hand with a bias, eps outside the root, over the whole projection (OLMo 2's);
- a difference that is a constant per query row before the softmax is a convention (MPT's ALiBi `m_h · (j − n + 1)`),
  and the experiments run in it (its fill-with-0 bug is `mask.filled_with_0`);
- RoPE's experiments after a qk-norm over the whole projection (`rope.base`, `rope.pairing` by experiment);
- a bias handed to F.linear that the code computes (BEiT's `cat(q_bias, zeros, v_bias)`), by keyword or position;
- a mask subtracted from the scores (`scores - attn_bias`, +inf where blocked), and BERT's `(1 - mask) · 10000`.

Correct code exits 0 with every step lined up; each style is checked apart from attnscope against
F.scaled_dot_product_attention or a float64 formula holding its weights, and each planted bug changes its output."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_columns_weights import ALIGNED
from test_trace_command import trace, user_module
from tracecases import assert_passes, run_case

from attnscope.usertrace import normforms
from attnscope.usertrace.align import row_spread
from attnscope.usertrace.masking import Convention, _subtracted, written

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round5_a.py")
styles = user_module(STYLES)


def _clean(runner, target: str, *args: str) -> dict:
    code, out = run_case(runner, STYLES, target, options=args)
    assert_passes(code, out)
    assert {row["status"] for row in out["alignment"]} <= ALIGNED, out["alignment"]
    return out


def _named(runner, target: str, init: str, entry: str, *args: str) -> dict:
    result, out = trace(runner, f"{STYLES}:{target}", "--init", init, *args)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == entry, out["first_divergence"]
    return out


# --- qk-norm forms ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("init", "args"), [
    ("form='offset'", ("--qk-norm", "head")),
    ("form='offset'", ()),  # read without --qk-norm
    ("form='layer'", ("--qk-norm", "head")),
    ("form='root_eps'", ("--qk-norm", "head")),
    ("form='offset', over='proj'", ("--qk-norm", "proj")),
])
def test_qk_norm_forms_line_up(runner, init, args):
    out = _clean(runner, "NormedHeads", "--init", init, "--causal", *args)
    assert any(row["reference"] == "Q_normed" and row["status"] in ALIGNED for row in out["alignment"])


@pytest.mark.parametrize(("init", "entry"), [
    ("form='offset', bug='kv_swap'", "kv.swapped"),
    ("form='offset', bug='scale_dmodel'", "scale.d_model"),
    ("form='layer', bug='axis'", "softmax.axis"),
    ("form='root_eps', bug='kv_swap'", "kv.swapped"),
    ("form='offset', over='proj', bug='kv_swap'", "kv.swapped"),  # experiments start from the normed heads
    ("form='layer', over='proj', bug='scale_dmodel'", "scale.d_model"),
])
def test_qk_norm_forms_bugs_named(runner, init, entry):
    _named(runner, "NormedHeads", init, entry, "--causal", "--qk-norm", "proj" if "proj" in init else "head")


def _qk_formula(module, x: torch.Tensor) -> torch.Tensor:
    """The NormedHeads styles apart from attnscope: each norm's formula in float64, then SDPA, causal."""
    b, n, d = x.shape
    h, dh = module.n_head, module.d_head
    x = x.double()

    def norm(t, m):
        w = m.weight.double()
        if isinstance(m, styles.OffsetRMSNorm):
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + m.eps) * (1 + w)
        if isinstance(m, styles.HandLayerNorm):
            return F.layer_norm(t, (t.shape[-1],), w, m.bias.double(), m.variance_epsilon)
        return t / (t.pow(2).mean(-1, keepdim=True).sqrt() + m.eps) * w

    q, k, v = (F.linear(x, lin.weight.double()) for lin in (module.wq, module.wk, module.wv))
    if module.over == "proj":
        q, k = norm(q, module.q_norm), norm(k, module.k_norm)
    q, k, v = (t.view(b, n, h, dh).transpose(1, 2) for t in (q, k, v))
    if module.over == "head":
        q, k = norm(q, module.q_norm), norm(k, module.k_norm)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, d)
    return F.linear(y, module.wo.weight.double())


@pytest.mark.parametrize(("form", "over"), [("offset", "head"), ("layer", "head"), ("root_eps", "head"),
                                            ("offset", "proj")])
def test_qk_norm_styles_against_formula(form, over):
    x = torch.randn(2, 5, 32)
    module = styles.NormedHeads(form=form, over=over)
    assert not torch.equal(module.q_norm.weight, torch.ones_like(module.q_norm.weight))  # moved off init
    assert not torch.equal(module.q_norm.weight, torch.zeros_like(module.q_norm.weight))
    with torch.no_grad():
        torch.testing.assert_close(module(x).double(), _qk_formula(module, x), atol=2e-5, rtol=1e-4)
        for bug in ("kv_swap", "scale_dmodel", "axis"):
            buggy = styles.NormedHeads(form=form, over=over, bug=bug)
            buggy.load_state_dict(module.state_dict())
            assert not torch.allclose(buggy(x), module(x), atol=1e-4), bug


def test_norm_forms_read_by_experiment():
    gemma = styles.OffsetRMSNorm(8)
    with torch.no_grad():
        gemma.weight.copy_(torch.linspace(-0.5, 0.5, 8))
    form = normforms.read(gemma, 8)
    assert form is not None and form.kind == "rms" and form.offset and form.eps == 1e-6
    hand = styles.HandLayerNorm(8)
    with torch.no_grad():
        hand.weight.copy_(torch.linspace(0.5, 1.5, 8))
        hand.bias.copy_(torch.linspace(-0.2, 0.3, 8))
    form = normforms.read(hand, 8)
    assert form is not None and form.kind == "layer" and not form.offset and form.eps == 1e-5
    torch.testing.assert_close(form.bias, hand.bias.detach())
    rms = torch.nn.RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        rms.weight.copy_(torch.linspace(0.5, 1.5, 8))
    form = normforms.read(rms, 8)
    assert form is not None and form.kind == "rms" and not form.offset
    form = normforms.read(torch.nn.RMSNorm(8), 8)  # eps=None: its dtype's machine epsilon
    assert form is not None and form.eps == torch.finfo(torch.float32).eps
    assert normforms.read(torch.nn.Dropout(), 8) is None  # no weight, and not a norm: x back
    assert normforms.read(torch.nn.Linear(8, 8), 8) is None


# --- a constant per row before the softmax: MPT's ALiBi --------------------------------------------------------

def test_row_shifted_alibi_is_a_convention(runner):
    out = _clean(runner, "RowShiftedAlibi", "--causal", "--alibi")
    shifted = [row for row in out["alignment"] if "constant per row" in (row.get("layout") or "")]
    assert {row["reference"] for row in shifted} >= {"biased_scores", "masked_scores"}, out["alignment"]


def test_row_shifted_alibi_fill0_named(runner):
    out = _named(runner, "RowShiftedAlibi", "bug='fill0'", "mask.filled_with_0", "--causal", "--alibi")
    assert "filled with 0" in out["first_divergence"]["diagnosis"]


def test_row_shifted_alibi_against_sdpa():
    x = torch.randn(2, 6, 32)
    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[0, 2] = False
    module = styles.RowShiftedAlibi()
    h, dh = module.n_head, module.d_head
    with torch.no_grad():
        q, k, v = (t.view(2, 6, h, dh).transpose(1, 2) for t in module.qkv(x).split(32, dim=-1))
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)]).view(1, h, 1, 1)
        i, j = torch.arange(6).view(6, 1), torch.arange(6).view(1, 6)
        bias = -slopes * (i - j)  # the paper's −m_h · (i − j)
        allowed = (j <= i) & pad[:, None, None, :]
        bias = bias.masked_fill(~allowed, float("-inf"))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(2, 6, 32)
        torch.testing.assert_close(module(x, pad), module.out(y), atol=1e-5, rtol=1e-5)
        buggy = styles.RowShiftedAlibi(bug="fill0")
        buggy.load_state_dict(module.state_dict())
        assert not torch.allclose(buggy(x, pad), module(x, pad), atol=1e-4)


def test_row_spread():
    reference = torch.tensor([[1.0, 2.0, float("-inf")], [0.5, -1.0, 3.0]])
    shifted = reference + torch.tensor([[4.0], [-2.0]])
    assert row_spread(shifted, reference, -1) == pytest.approx(0.0)
    other = shifted.clone()
    other[1, 0] += 0.5
    assert row_spread(other, reference, -1) == pytest.approx(1 / 3, rel=1e-6)
    masked_elsewhere = shifted.clone()
    masked_elsewhere[0, 1] = float("-inf")
    assert row_spread(masked_elsewhere, reference, -1) is None


# --- RoPE after a qk-norm over the whole projection -----------------------------------------------------------------

def test_table_rope_normed_correct(runner):
    _clean(runner, "TableRope", "--causal", "--rope", "--qk-norm", "proj")


@pytest.mark.parametrize(("bug", "entry"), [("base", "rope.base"), ("table", "rope.pairing")])
@pytest.mark.parametrize("normed", [True, False])
def test_table_rope_bugs_named_by_experiment(runner, bug, entry, normed):
    args = ("--qk-norm", "proj") if normed else ()
    out = _named(runner, "TableRope", f"normed={normed}, bug={bug!r}", entry, "--causal", "--rope", *args)
    assert out["first_divergence"]["reference"] == "Q_rot"
    evidence = out["first_divergence"]["evidence"] or ""
    assert evidence and not evidence.startswith("not by experiment"), out["first_divergence"]


def test_table_rope_against_formula():
    x = torch.randn(2, 5, 32)
    module = styles.TableRope()
    h, dh = module.n_head, module.d_head
    with torch.no_grad():
        def rms(t, m):
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * m.weight

        q = rms(module.q_proj(x), module.q_norm).view(2, 5, h, dh).transpose(1, 2)
        k = rms(module.k_proj(x), module.k_norm).view(2, 5, h, dh).transpose(1, 2)
        v = module.v_proj(x).view(2, 5, h, dh).transpose(1, 2)
        # pairs (i, i + dh/2) turn by position · 50000^(-2i/dh)
        angle = torch.arange(5.0)[:, None] * 50000.0 ** (-torch.arange(0, dh, 2).float() / dh)
        cos, sin = angle.cos(), angle.sin()

        def turn(t):
            a, b = t[..., : dh // 2], t[..., dh // 2:]
            return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

        y = F.scaled_dot_product_attention(turn(q), turn(k), v, is_causal=True).transpose(1, 2).reshape(2, 5, 32)
        torch.testing.assert_close(module(x), module.o_proj(y), atol=1e-5, rtol=1e-5)
        for bug in ("base", "table"):
            buggy = styles.TableRope(bug=bug)
            buggy.load_state_dict(module.state_dict())
            assert not torch.allclose(buggy(x), module(x), atol=1e-4), bug


# --- a bias computed from parameters, handed to F.linear -------------------------------------------------------------

@pytest.mark.parametrize("init", ["positional=False", "positional=True"])
def test_cat_bias_read(runner, init):
    _clean(runner, "CatBias", "--init", init)


@pytest.mark.parametrize(("bug", "entry"), [("kv_swap", "kv.swapped"), ("scale_none", "scale.none")])
def test_cat_bias_bugs_named(runner, bug, entry):
    _named(runner, "CatBias", f"bug={bug!r}", entry)


def test_cat_bias_against_sdpa():
    x = torch.randn(2, 5, 32)
    module = styles.CatBias()
    with torch.no_grad():
        w = module.qkv.weight
        q = F.linear(x, w[:32], module.q_bias)
        k = F.linear(x, w[32:64])  # k has no bias
        v = F.linear(x, w[64:], module.v_bias)
        heads = [t.view(2, 5, 4, 8).transpose(1, 2) for t in (q, k, v)]
        y = F.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(2, 5, 32)
        torch.testing.assert_close(module(x), module.proj(y), atol=1e-5, rtol=1e-5)
        positional = styles.CatBias(positional=True)
        positional.load_state_dict(module.state_dict())
        torch.testing.assert_close(positional(x), module(x))
        for bug in ("kv_swap", "scale_none"):
            buggy = styles.CatBias(bug=bug)
            buggy.load_state_dict(module.state_dict())
            assert not torch.allclose(buggy(x), module(x), atol=1e-4), bug


def test_param_cat_bias(runner):
    _clean(runner, "ParamCatBias")
    _named(runner, "ParamCatBias", "bug='kv_swap'", "kv.swapped")


def test_param_cat_bias_against_sdpa():
    x = torch.randn(2, 5, 32)
    module = styles.ParamCatBias()
    with torch.no_grad():
        w = module.W_qkv
        q, k, v = x @ w[:, :32] + module.q_bias, x @ w[:, 32:64], x @ w[:, 64:] + module.v_bias
        heads = [t.view(2, 5, 4, 8).transpose(1, 2) for t in (q, k, v)]
        y = F.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(2, 5, 32)
        torch.testing.assert_close(module(x), y @ module.W_o + module.b_o, atol=1e-5, rtol=1e-5)
        buggy = styles.ParamCatBias(bug="kv_swap")
        buggy.load_state_dict(module.state_dict())
        assert not torch.allclose(buggy(x), module(x), atol=1e-4)


# --- a mask subtracted from the scores -------------------------------------------------------------------------------

def test_subtracted_bias_read(runner):
    out = _clean(runner, "SubtractedBias", "--causal")
    assert any("subtracted from the scores" in note for note in out["notes"]), out["notes"]


@pytest.mark.parametrize(("bug", "entry"), [("kv_swap", "kv.swapped"), ("scale_none", "scale.none")])
def test_subtracted_bias_bugs_named(runner, bug, entry):
    _named(runner, "SubtractedBias", f"bug={bug!r}", entry, "--causal")


def test_subtracted_zero_one(runner):
    _clean(runner, "SubtractedZeroOne", "--causal")
    _named(runner, "SubtractedZeroOne", "bug='polarity'", "mask.polarity", "--causal")


def test_subtracted_styles_against_sdpa():
    x = torch.randn(2, 5, 32)
    keep = torch.ones(5, 5, dtype=torch.bool).tril()
    for cls, names, mask in ((styles.SubtractedBias, ("to_q", "to_k", "to_v", "to_out"),
                              -torch.zeros(5, 5).masked_fill(~keep, float("-inf"))),  # 0 / +inf
                             (styles.SubtractedZeroOne, ("query", "key", "value", "dense"), keep.float())):
        module = cls()
        q, k, v, o = (getattr(module, n) for n in names)
        with torch.no_grad():
            heads = [lin(x).view(2, 5, 4, 8).transpose(1, 2) for lin in (q, k, v)]
            y = F.scaled_dot_product_attention(*heads, is_causal=True).transpose(1, 2).reshape(2, 5, 32)
            torch.testing.assert_close(module(x, mask), o(y), atol=1e-5, rtol=1e-5)
            for bug in ("kv_swap", "scale_none") if cls is styles.SubtractedBias else ("polarity",):
                buggy = cls(bug=bug)
                buggy.load_state_dict(module.state_dict())
                assert not torch.allclose(buggy(x, mask), module(x, mask), atol=1e-4), bug


def test_subtraction_read_from_the_op():
    assert _subtracted("scores - attn_bias", "attn_bias")
    assert _subtracted("torch.sub(scores, attn_bias)", "attn_bias")
    assert _subtracted("scores.sub_(attn_bias)", "attn_bias")
    assert not _subtracted("1 - mask", "mask")
    assert not _subtracted("1.0 - mask", "mask")
    assert not _subtracted("scores - attn_bias2", "attn_bias")
    keep = torch.tensor([[True, False], [True, True]])
    assert torch.equal(written(keep, "subtracted", torch.float32), torch.tensor([[0.0, math.inf], [0.0, 0.0]]))
    assert "subtracts the mask" in Convention("subtracted", 3, "scores - m").note("m")
