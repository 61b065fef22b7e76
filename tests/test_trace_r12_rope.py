"""`attnscope trace` on round 12's RoPE and softmax conventions (tests/trace_styles_r12_rope.py): RoPE turned by −θ
(nanochat's) is read from the code's rotated tensors as its pairing is, a note and exit 0, and the plants in such
code are named by experiment; a code that turns q and k opposite ways is no convention. Each style is checked here
against a float64 formula of its own (each pair turned coordinate by coordinate) or SDPA, each bug shown to change
the output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_r12_rope.py")
styles = user_module(STYLES)


def _moved(module):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return module.double()


def _turned64(x, positions, pairs, sign):
    """x [b, h, n, d] in float64, pair i (the coordinates `pairs(i)`) turned by sign · p · 10000^(-2i/d)."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        a, b = pairs(i, d)
        theta = sign * positions.double() * 10000.0 ** (-2 * i / d)  # [n]
        c, s = theta.cos(), theta.sin()
        out[..., a], out[..., b] = x[..., a] * c - x[..., b] * s, x[..., a] * s + x[..., b] * c
    return out


def _half(i, d):
    return i, i + d // 2


def _interleaved(i, d):
    return 2 * i, 2 * i + 1


def _rms(t):
    return t / t.pow(2).mean(-1, keepdim=True).add(torch.finfo(t.dtype).eps).sqrt()


def test_the_minus_theta_styles_are_their_formulas_and_the_bugs_change_them():
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    m = _moved(styles.MinusHalves())
    q, k, v = (lin(x).view(2, 5, -1, 8).transpose(1, 2) for lin in (m.c_q, m.c_k, m.c_v))
    pos = torch.arange(5)
    q, k = _rms(_turned64(q, pos, _half, -1)), _rms(_turned64(k, pos, _half, -1))
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    want = m.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(m(x), want, atol=1e-10)
    assert not torch.allclose(_moved(styles.MinusHalves(bug="tiled"))(x), want, atol=1e-3)
    cache = (torch.randn(2, 2, 3, 8, dtype=torch.float64), torch.randn(2, 2, 3, 8, dtype=torch.float64))
    step = m(x, cache)
    for bug in ("new_first", "no_offset", "is_causal"):
        assert not torch.allclose(_moved(styles.MinusHalves(bug=bug))(x, cache), step, atol=1e-3), bug

    x = torch.randn(2, 5, 24, dtype=torch.float64)
    c = _moved(styles.ConjComplex())
    q, k, v = (lin(x).view(2, 5, 3, 8).transpose(1, 2) for lin in (c.wq, c.wk, c.wv))
    q, k = _turned64(q, pos, _interleaved, -1), _turned64(k, pos, _interleaved, -1)
    want = c.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 5, 24))
    assert torch.allclose(c(x), want, atol=1e-5)  # the complex product runs in float32, as Meta's does
    for bug in ("no_scale", "kv_swapped"):
        assert not torch.allclose(_moved(styles.ConjComplex(bug=bug))(x), want, atol=1e-3), bug

    x = torch.randn(2, 5, 32, dtype=torch.float64)
    r = _moved(styles.MinusRotateHalf())
    q, k, v = (lin(x).view(2, 5, 4, 8).transpose(1, 2) for lin in (r.query, r.key, r.value))
    q, k = _turned64(q, pos, _half, -1), _turned64(k, pos, _half, -1)
    want = r.dense(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(r(x), want, atol=1e-10)
    assert not torch.allclose(_moved(styles.MinusRotateHalf(bug="q_only"))(x), want, atol=1e-3)


MINUS = [("MinusHalves", ()), ("MinusHalves", ("--cache", "3")), ("MinusHalves", ("--cache", "3", "--nq", "1")),
         ("ConjComplex", ()), ("MinusRotateHalf", ())]


@pytest.mark.parametrize(("name", "more"), MINUS, ids=[f"{n}{''.join(m)}" for n, m in MINUS])
def test_rope_by_minus_theta_is_a_convention(runner, name, more):
    result, out = trace(runner, f"{STYLES}:{name}", "--rope", "--causal", *more)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any("turns each pair by −θ" in n and "A convention, not a mistake" in n for n in out["notes"]), out["notes"]


MINUS_BUGS = [("MinusHalves", "tiled", (), "gqa.tiled"), ("MinusHalves", "new_first", ("--cache", "3"), "cache.order"),
              ("MinusHalves", "no_offset", ("--cache", "3"), "rope.positions"),
              ("MinusHalves", "is_causal", ("--cache", "3"), "mask.upper_left"),
              ("ConjComplex", "no_scale", (), "scale.none"), ("ConjComplex", "kv_swapped", (), "kv.swapped")]


@pytest.mark.parametrize(("name", "bug", "more", "experiment"), MINUS_BUGS, ids=[f"{c[0]}-{c[1]}" for c in MINUS_BUGS])
def test_mistakes_in_minus_theta_code_are_named_by_experiment(runner, name, bug, more, experiment):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug='{bug}'", "--rope", "--causal", *more)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == experiment, out["first_divergence"]


def test_q_and_k_turned_opposite_ways_is_no_convention(runner):
    result, out = trace(runner, f"{STYLES}:MinusRotateHalf", "--init", "bug='q_only'", "--rope", "--causal")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert not any("A convention, not a mistake" in n for n in out["notes"]), out["notes"]


# --- a (cos, sin) pair in one parameter; tables half the head wide ------------------------------------------------


def _tables64(n, d, base=10000.0):  # [n, d / 2] each, float64: one angle a pair over the whole head
    angle = torch.arange(n, dtype=torch.float64)[:, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    return angle.cos(), angle.sin()


def _heads(lin, x, n_heads):  # [b, n, h·d] -> [b, h, n, d]
    b, n, _ = x.shape
    return lin(x).view(b, n, n_heads, -1).transpose(1, 2)


def _merged(out):  # [b, h, n, d] -> [b, n, h·d]
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


def test_the_table_styles_are_their_formulas():
    x, pos = torch.randn(2, 5, 32, dtype=torch.float64), torch.arange(5)
    cos, sin = _tables64(5, 8)
    m = _moved(styles.CosSinPair())
    q, k, v = _heads(m.c_q, x, 4), _heads(m.c_k, x, 2), _heads(m.c_v, x, 2)
    q, k = _turned64(q, pos, _half, -1), _turned64(k, pos, _half, -1).repeat_interleave(2, 1)
    want = m.c_proj(_merged(F.scaled_dot_product_attention(q, k, v.repeat_interleave(2, 1), is_causal=True)))
    assert torch.allclose(m(x, (cos[None, :, None], sin[None, :, None])), want, atol=1e-10)

    r = _moved(styles.IndexedRotary())
    q, k, v = (_heads(p, x, 4) for p in (r.q_proj, r.k_proj, r.v_proj))
    q, k = _turned64(q, pos, _half, 1), _turned64(k, pos, _half, 1)
    want = r.o_proj(_merged(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    full = (torch.cat((cos, cos), -1).expand(2, 5, 8), torch.cat((sin, sin), -1).expand(2, 5, 8))
    assert torch.allclose(r(x, full), want, atol=1e-10)
    assert not torch.allclose(_moved(styles.IndexedRotary(bug="no_scale"))(x, full), want, atol=1e-3)

    e = _moved(styles.EvenOddFreqs())
    q, k, v = (_heads(lambda t, i=i: e.to_qkv(t).chunk(3, -1)[i], x, 4) for i in range(3))
    q, k = _turned64(q, pos, _interleaved, 1), _turned64(k, pos, _interleaved, 1)
    want = e.to_out(_merged(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    assert torch.allclose(e(x, (cos, sin)), want, atol=1e-10)

    h = _moved(styles.SplitHalves())
    q, k, v = _heads(h.q_proj, x, 4), _heads(h.k_proj, x, 2), _heads(h.v_proj, x, 2)
    q, k = _turned64(q, pos, _half, 1), _turned64(k, pos, _half, 1).repeat_interleave(2, 1)
    want = h.o_proj(_merged(F.scaled_dot_product_attention(q, k, v.repeat_interleave(2, 1))))
    assert torch.allclose(h(x, (cos.expand(2, 5, 4), sin.expand(2, 5, 4))), want, atol=1e-10)

    t = _moved(styles.SeparateHalfTables())
    q, k, v = (_heads(w, x, 4) for w in (t.wq, t.wk, t.wv))
    q, k = _turned64(q, pos, _half, 1), _turned64(k, pos, _half, 1)
    want = t.wo(_merged(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    assert torch.allclose(t(x, cos, sin), want, atol=1e-10)


TABLES = ["CosSinPair", "IndexedRotary", "EvenOddFreqs", "SplitHalves", "SeparateHalfTables"]


@pytest.mark.parametrize("name", TABLES)
def test_tables_are_made_in_the_form_the_code_runs_on(runner, name):
    result, out = trace(runner, f"{STYLES}:{name}", "--rope", "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert not any("rotary fraction" in n for n in out["notes"]), out["notes"]
    if name in ("CosSinPair", "SplitHalves", "SeparateHalfTables", "EvenOddFreqs"):
        assert any("one angle a pair" in n for n in out["notes"]), out["notes"]


def test_a_mistake_beside_a_pair_of_tables_is_named_by_experiment(runner):
    result, out = trace(runner, f"{STYLES}:IndexedRotary", "--init", "bug='no_scale'", "--rope", "--causal")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "scale.none", out["first_divergence"]


# --- attention sinks ----------------------------------------------------------------------------------------------


def test_gpt_oss_sinks_are_transformers_eager_attention():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

    config = GptOssConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    config._attn_implementation = "eager"
    theirs = GptOssAttention(config, layer_idx=1).double().eval()
    mine = _moved(styles.GptOssSinks())
    theirs.load_state_dict(mine.state_dict())
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    cos, sin = GptOssRotaryEmbedding(config).double()(x, torch.arange(6)[None].expand(2, 6))
    mask = torch.full((6, 6), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    want, weights = theirs(x, (cos, sin), mask)
    got, got_weights = mine(x, (cos, sin), mask)
    assert torch.allclose(got, want, atol=1e-10) and torch.allclose(got_weights, weights, atol=1e-10)
    assert bool((weights.sum(-1) < 1 - 1e-3).any())  # the sinks take weight: the rows sum to less than 1
    for bug in ("kv_swapped", "mask_after_softmax", "scale_d_model"):
        wrong = _moved(styles.GptOssSinks(bug=bug))
        assert not torch.allclose(wrong(x, (cos, sin), mask)[0], want, atol=1e-3), bug


def _sunk64(scores, sink, first=False):  # softmax over the keys and one sink logit a head, the sink dropped
    column = sink.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    joined = torch.cat((column, scores) if first else (scores, column), -1).softmax(-1)
    return joined[..., 1:] if first else joined[..., :-1]


def test_the_other_sink_styles_are_their_formulas():
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    s = _moved(styles.SinkFirst())
    q, k, v = (_heads(w, x, 4) for w in (s.W_q, s.W_k, s.W_v))
    scores = (q @ k.transpose(-2, -1) / 8 ** 0.5).masked_fill(causal, float("-inf"))
    want = s.W_o(_merged(_sunk64(scores, s.sink_logits, first=True) @ v))
    keep = (~causal).double()
    assert torch.allclose(s(x, keep), want, atol=1e-10)
    assert not torch.allclose(_moved(styles.SinkFirst(bug="no_scale"))(x, keep), want, atol=1e-3)
    e = _moved(styles.EinsumSinks())
    q = _heads(e.to_q, x, 4)
    k, v = (_heads(lambda t, i=i: e.to_kv(t).chunk(2, -1)[i], x, 2).repeat_interleave(2, 1) for i in range(2))
    scores = (q @ k.transpose(-2, -1) / 8 ** 0.5).masked_fill(causal, float("-inf"))
    want = e.to_out(_merged(_sunk64(scores, e.s) @ v))
    assert torch.allclose(e(x), want, atol=1e-10)
    assert not torch.allclose(_moved(styles.EinsumSinks(bug="tiled"))(x), want, atol=1e-3)


SINKS = [("GptOssSinks", ("--rope", "--causal")), ("GptOssSinks", ("--rope", "--window", "4")),
         ("GptOssSinks", ("--init", "sinks_init=-1e4", "--rope", "--causal")), ("SinkFirst", ("--causal",)),
         ("EinsumSinks", ("--causal",))]


@pytest.mark.parametrize(("name", "more"), SINKS, ids=[f"{n}{''.join(m)}" for n, m in SINKS])
def test_attention_sinks_the_module_holds_are_its_convention(runner, name, more):
    result, out = trace(runner, f"{STYLES}:{name}", *more)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any(n.startswith("attention sinks:") for n in out["notes"]), out["notes"]
    assert not any("masks by itself" in n for n in out["notes"]), out["notes"]  # a sink at -1e4 weighs nothing


SINK_BUGS = [("GptOssSinks", "kv_swapped", ("--rope",), "kv.swapped"),
             ("GptOssSinks", "mask_after_softmax", ("--rope",), "mask.after_softmax"),
             ("GptOssSinks", "scale_d_model", ("--rope",), "scale.d_model"),
             ("SinkFirst", "no_scale", (), "scale.none"), ("EinsumSinks", "tiled", (), "gqa.tiled")]


@pytest.mark.parametrize(("name", "bug", "more", "experiment"), SINK_BUGS, ids=[f"{c[0]}-{c[1]}" for c in SINK_BUGS])
def test_mistakes_beside_sinks_are_named_by_experiment(runner, name, bug, more, experiment):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug='{bug}'", "--causal", *more)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == experiment, out["first_divergence"]
