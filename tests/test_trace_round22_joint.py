"""Joint (two-stream) attention's mistakes in one stream's own steps, before the join (round 20's SD3 module with the
context's k-norm left out, its v normed by the k-norm, its k and v swapped at the join: all exit 0, the reference
starting from the joined q, k, v that already held them). usertrace/jointstreams.py now reads each stream's q, k and v
against the heads its own projections make (q and k normalized alike in every stream, v as projected) and names a
stream that differs by experiment. Styles of our own (tests/trace_styles_round22_joint.py), each checked against
F.scaled_dot_product_attention in float64 on its own weights; each plant shown to change the output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round22_joint.py")
styles = user_module(STYLES)


def _rms(t, w):  # over each head's features
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _layer(t, g, b):  # a LayerNorm over each head's features, by its formula
    c = t - t.mean(-1, keepdim=True)
    return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-5) * g + b


def _heads(t, h=4):  # [B, L, H·D] -> [B, H, L, D]
    return t.view(*t.shape[:2], h, -1).transpose(1, 2)


def _merge(t):  # [B, H, L, D] -> [B, L, H·D]
    return t.transpose(1, 2).flatten(2)


def _lin(t, w, b=None):
    return t @ w.T + (b if b is not None else 0)


def _same(got, want):
    return all(torch.allclose(a, b, atol=1e-10) for a, b in zip(got, want, strict=True))


def _sd3(m, x, c, context_first=False):
    proj = {r: (getattr(m, f"to_{r}"), getattr(m, f"add_{r}_proj")) for r in "qkv"}
    xs = [_heads(_lin(x, p[0].weight, p[0].bias)) for p in proj.values()]
    cs = [_heads(_lin(c, p[1].weight, p[1].bias)) for p in proj.values()]
    xs[0], xs[1] = _rms(xs[0], m.norm_q.weight), _rms(xs[1], m.norm_k.weight)
    cs[0], cs[1] = _rms(cs[0], m.norm_added_q.weight), _rms(cs[1], m.norm_added_k.weight)
    q, k, v = (torch.cat([b, a] if context_first else [a, b], 2) for a, b in zip(xs, cs, strict=True))
    y = _merge(F.scaled_dot_product_attention(q, k, v))
    n, s = x.shape[1], c.shape[1]
    yx, yc = (y[:, s:], y[:, :s]) if context_first else (y[:, :n], y[:, n:])
    out_c = _lin(yc, m.to_add_out.weight, m.to_add_out.bias) if m.to_add_out is not None else yc
    return _lin(yx, m.to_out.weight, m.to_out.bias), out_c


def _flux(m, img, txt):
    def qkv(layer, t):
        return [_heads(p) for p in _lin(t, layer.weight, layer.bias).chunk(3, -1)]

    iq, ik, iv = qkv(m.img_qkv, img)
    tq, tk, tv = qkv(m.txt_qkv, txt)
    iq, ik = _rms(iq, m.img_norm.query_scale), _rms(ik, m.img_norm.key_scale)
    tq, tk = _rms(tq, m.txt_norm.query_scale), _rms(tk, m.txt_norm.key_scale)
    y = _merge(F.scaled_dot_product_attention(torch.cat([tq, iq], 2), torch.cat([tk, ik], 2), torch.cat([tv, iv], 2)))
    s = txt.shape[1]
    return (_lin(y[:, s:], m.img_proj.weight, m.img_proj.bias), _lin(y[:, :s], m.txt_proj.weight, m.txt_proj.bias))


def _functional(m, x, c):
    w = dict(m.named_parameters())
    parts = []
    for s, t in (("img", x), ("txt", c)):
        q, k, v = (_heads(_lin(t, w[f"{s}_w{r}"], w[f"{s}_b{r}"]), w[f"{s}_w{r}"].shape[0] // 8) for r in "qkv")
        parts.append((_layer(q, w[f"{s}_qnorm_g"], w[f"{s}_qnorm_b"]), _layer(k, w[f"{s}_knorm_g"],
                                                                              w[f"{s}_knorm_b"]), v))
    q, k, v = (torch.cat(pair, 2) for pair in zip(*parts, strict=True))
    y = _merge(F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1]))
    n = x.shape[1]
    return _lin(y[:, :n], w["img_wo"]), _lin(y[:, n:], w["txt_wo"])


def test_the_styles_are_sdpa_on_their_own_weights_and_each_plant_changes_them():
    g = torch.Generator().manual_seed(0)
    x, c = (torch.randn(2, n, 32, generator=g, dtype=torch.float64) for n in (6, 4))
    with torch.no_grad():
        made = [(styles.SD3Joint().double(), lambda m: _sd3(m, x, c), (x, c)),
                (styles.SD3Joint(shared=True, context_first=True).double(), lambda m: _sd3(m, x, c, True), (x, c)),
                (styles.FluxDouble().double(), lambda m: _flux(m, x, c), (x, c)),
                (styles.FunctionalJoint().double(), lambda m: _functional(m, x, c), (x, c)),
                (styles.FunctionalJoint(kv_heads=2).double(), lambda m: _functional(m, x, c), (x, c))]
        for m, want_of, args in made:
            want = want_of(m)
            assert _same(m(*args), want), type(m).__name__
            for bug in ("ctx_knorm_missing", "ctx_v_knormed", "ctx_kv_swapped", "unpack_swapped"):
                if bug == "unpack_swapped" and not isinstance(m, styles.FluxDouble):
                    continue
                m.bug = bug
                assert not _same(m(*args), want), (type(m).__name__, bug)
            m.bug = None
        shared = styles.SD3Joint(shared=True, context_out=False).double()
        assert shared.norm_added_k is shared.norm_k and shared.to_add_out is None
        assert _same(shared(x, c), _sd3(shared, x, c))


CORRECT = [("SD3Joint", None), ("SD3Joint", "shared=True, context_first=True, context_out=False"),
           ("FluxDouble", None), ("FunctionalJoint", None), ("FunctionalJoint", "kv_heads=2")]


@pytest.mark.parametrize(("target", "init"), CORRECT, ids=case_ids(CORRECT))
def test_correct_joint_code_passes_with_each_stream_read(runner, target, init):
    code, out = run_case(runner, STYLES, target, init, ("--nk", "5"))
    assert_passes(code, out)
    assert any("each stream's q, k and v" in note for note in out["notes"]), out["notes"]


PLANTS = [(target, bug, cause, step) for target in ("SD3Joint", "FluxDouble", "FunctionalJoint")
          for bug, cause, step in (("ctx_knorm_missing", "qknorm.missing", "K_split"),
                                   ("ctx_v_knormed", "qknorm.on_values", "V_split"),
                                   ("ctx_kv_swapped", "kv.swapped", "K_split"))] + [
    ("FluxDouble", "unpack_swapped", "kv.swapped", "K_split"),
    ("SD3Joint", "shared=True, context_first=True, bug='ctx_kv_swapped'", "kv.swapped", "K_split"),
    ("FunctionalJoint", "kv_heads=2, bug='ctx_v_knormed'", "qknorm.on_values", "V_split")]


@pytest.mark.parametrize(("target", "bug", "cause", "step"), PLANTS, ids=case_ids(PLANTS))
def test_a_mistake_in_one_stream_is_named_by_experiment(runner, target, bug, cause, step):
    init = bug if "=" in bug else f"bug='{bug}'"
    code, out = run_case(runner, STYLES, target, init, ("--nk", "5"))
    found = assert_named(code, out, cause)
    assert found["reference"] == step and " one stream" in found["diagnosis"], found


# a stream of as many tokens as heads: its heads [B, L, H, D] (joined on dim 1) have the shape of [B, H, L, D], and
# the straight view that makes them is the right one (joint.split_fault read it as heads split without the
# transpose: a false alarm on the correct FunctionalJoint with 4 context tokens and 4 heads)
SQUARE = [("FunctionalJoint", None, None), ("FunctionalJoint", "bug='ctx_knorm_missing'", "qknorm.missing"),
          ("FunctionalJoint", "bug='ctx_kv_swapped'", "kv.swapped"), ("SD3Joint", None, None),
          ("SD3Joint", "bug='ctx_v_knormed'", "qknorm.on_values")]


@pytest.mark.parametrize(("target", "init", "cause"), SQUARE, ids=case_ids(SQUARE))
def test_a_stream_of_as_many_tokens_as_heads(runner, target, init, cause):
    code, out = run_case(runner, STYLES, target, init, ("--nq", "6", "--nk", "4"))
    if cause is None:
        assert_passes(code, out)
    else:
        assert_named(code, out, cause)


# --nk given as long as --nq still feeds the optional second stream: the user asked for keys of that length, which
# self-attention would take from the queries' own input (the joint path was left unfed and unchecked before)
EQUAL = [("SD3Joint", None, None), ("FluxDouble", "bug='ctx_kv_swapped'", "kv.swapped"),
         ("SD3Joint", "bug='ctx_knorm_missing'", "qknorm.missing")]


@pytest.mark.parametrize(("target", "init", "cause"), EQUAL, ids=case_ids(EQUAL))
def test_nk_as_long_as_nq_feeds_the_second_stream(runner, target, init, cause):
    code, out = run_case(runner, STYLES, target, init, ("--nq", "5", "--nk", "5"))
    if cause is None:
        assert_passes(code, out)
        assert any("each stream's q, k and v" in note for note in out["notes"]), out["notes"]
    else:
        assert_named(code, out, cause)
