"""`attnscope trace` where a module's own bias says which block of a fused projection is the keys' (a constant-zero
block beside learned ones: BEiT's `cat(q_bias, zeros_like(v_bias), v_bias)`, EVA's zero buffer, a `new_zeros`
chunk, a fused K/V's `cat(zeros, v_bias)`, a Linear without a bias among ones whose names say no role):
unpacking the fused output with k and v named the other way round is
kv.swapped by experiment, while the same rename over blocks that are alike stays a layout of the weights (a note).
Styles: tests/trace_styles_f12_kv.py, each checked against F.scaled_dot_product_attention in float64, each plant
shown to change the output."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_f12_kv.py")
styles = user_module(STYLES)
KV_STYLES = ["CatZerosBias", "ZeroBufferBias", "ChunkedParamBias", "KVZeroBias", "ProjList"]


def _heads(t, h):
    b, n, d = t.shape
    return t.view(b, n, h, d // h).transpose(1, 2)


def _sdpa(q, k, v, h):
    y = F.scaled_dot_product_attention(_heads(q, h), _heads(k, h), _heads(v, h))
    return y.transpose(1, 2).reshape(q.shape)


def _want(m, x):
    """The module's attention in float64 from its weights: q, k, v by the bias's blocks (the keys' a zero), SDPA."""
    d = x.shape[-1]
    if isinstance(m, styles.KVZeroBias):
        k, v = F.linear(x, m.to_kv.weight).split(d, -1)
        return m.to_out(_sdpa(m.to_q(x), k, v + m.v_bias, 4))
    if isinstance(m, styles.ProjList):  # the keys' Linear is the one without a bias
        return m.out(_sdpa(m.projs[0](x), m.projs[1](x), m.projs[2](x), 4))
    if isinstance(m, styles.ChunkedParamBias):
        q, k, v = (x @ m.w_qkv).split(d, -1)
        b_q, _, b_v = m.b_qkv.chunk(3)
        return m.w_out(_sdpa(q + b_q, k, v + b_v, 4))
    q, k, v = F.linear(x, m.qkv.weight).split(d, -1)
    k_bias = m.k_bias if getattr(m, "k_bias", None) is not None else 0
    return (m.proj if hasattr(m, "proj") else m.out)(_sdpa(q + m.q_bias, k + k_bias, v + m.v_bias, 4))


@pytest.mark.parametrize("name", KV_STYLES)
def test_the_styles_are_sdpa_and_the_renames_change_them(name):
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    m = getattr(styles, name)().double()
    with torch.no_grad():
        want = _want(m, x)
        assert torch.allclose(m(x), want, atol=1e-10)
        wrong = getattr(styles, name)(bug="kv_renamed").double()
        wrong.load_state_dict(m.state_dict())
        assert (wrong(x) - want).abs().max() > 1e-2


@pytest.mark.parametrize("name", KV_STYLES)
def test_correct_forms_pass_and_the_rename_is_a_swap_by_experiment(runner, name):
    result, out = trace(runner, f"{STYLES}:{name}")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert not any("a layout of your weights" in n for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:{name}", "--init", "bug='kv_renamed'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "kv.swapped", out["first_divergence"]
    assert out["first_divergence"]["evidence"].startswith("by experiment")


def test_the_bias_is_what_says_it(runner):
    """The reference says it holds k and v as the bias gives them; with a learned bias on all three blocks the same
    rename is a layout of the weights (a note, exit 0): nothing in the module tells the blocks apart."""
    result, out = trace(runner, f"{STYLES}:CatZerosBias", "--init", "bug='kv_renamed'")
    assert "k and v as your bias gives them (line" in out["reference"], out["reference"]
    assert "torch.zeros_like(v_bias, requires_grad=False), the keys' bias a constant zero" in out["reference"]
    result, out = trace(runner, f"{STYLES}:CatZerosBias", "--init", "bug='kv_renamed', key_bias=True")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any("qkv's rows hold q, v, k, as your code reads them" in n for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:KVZeroBias", "--init", "bug='kv_renamed'")
    assert "k and v as your bias gives them" in out["reference"], out["reference"]
    result, out = trace(runner, f"{STYLES}:ProjList", "--init", "bug='kv_renamed'")
    assert "k and v as their biases give them: projs.1 has none" in out["reference"], out["reference"]


# --- a term of the module's own on its attention's output ---------------------------------------------------------

PAD = str(Path(__file__).resolve().parent.parent / "docs" / "examples" / "pad_2x9.npy")
OUT_ARGS = {"ShawKeysValues": ("--causal",), "PositionOutputBias": ("--causal",), "KeyPositionValues": (),
            "ShawValuesTimeMajor": ("--batch", "2", "--nq", "6", "--nk", "9", "--mask", PAD)}
OUT_BUGS = {"ShawKeysValues": ("no_scale", "diagonal", "softmax_dim"),
            "ShawValuesTimeMajor": ("scale_hid", "fill_zero"), "PositionOutputBias": ("no_scale", "softmax_dim"),
            "KeyPositionValues": ("scale_d_model", "softmax_dim")}


def _shaw64(m, x):
    """Shaw et al. in float64, written out: a_ij = table[clip(j − i)], scores (q·k + q·a^K) / √d, out attn·(v + a^V)."""
    b, n, _ = x.shape
    q, k, v = (_heads(w(x), m.h) for w in (m.wq, m.wk, m.wv))
    index = torch.tensor([[min(max(j - i, -m.clip), m.clip) + m.clip for j in range(n)] for i in range(n)])
    a_k, a_v = m.rel_k[index], m.rel_v[index]
    scores = (q @ k.transpose(-2, -1) + torch.einsum("bhid,ijd->bhij", q, a_k)) / math.sqrt(m.dk)
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    attn = scores.masked_fill(future, -math.inf).softmax(-1)
    out = attn @ v + torch.einsum("bhij,ijd->bhid", attn, a_v)
    return m.wo(out.transpose(1, 2).reshape(b, n, -1))


def _out_want(name, m, x, y=None, keep=None):
    if name == "ShawKeysValues":
        return _shaw64(m, x)
    if name == "PositionOutputBias":
        q, k, v = m.qkv(x).split(32, -1)
        out = F.scaled_dot_product_attention(_heads(q, 4), _heads(k, 4), _heads(v, 4), is_causal=True)
        return m.proj((out + m.out_pos[:, :x.shape[1]]).transpose(1, 2).reshape(x.shape))
    if name == "KeyPositionValues":  # attn @ v + attn @ pos_v = attn @ (v + pos_v)
        v = _heads(m.to_v(x), 4) + m.pos_v[:x.shape[1]]
        out = F.scaled_dot_product_attention(_heads(m.to_q(x), 4), _heads(m.to_k(x), 4), v)
        return m.to_out(out.transpose(1, 2).reshape(x.shape))
    n_q, n_k = x.shape[1], y.shape[1]  # ShawValuesTimeMajor, a key padding mask [b, 1, 1, n_k]
    q, k, v = _heads(m.fc_q(x), 4), _heads(m.fc_k(y), 4), _heads(m.fc_v(y), 4)
    attn = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(~keep, -math.inf).softmax(-1)
    index = torch.tensor([[min(max(j - i, -2), 2) + 2 for j in range(n_k)] for i in range(n_q)])
    out = attn @ v + torch.einsum("bhij,ijd->bhid", attn, m.table_v[index])
    return m.fc_o(out.transpose(1, 2).reshape(x.shape))


@pytest.mark.parametrize("name", list(OUT_BUGS))
def test_the_output_term_styles_are_their_formulas_and_the_bugs_change_them(name):
    torch.manual_seed(0)
    m = getattr(styles, name)().double()
    with torch.no_grad():
        if name == "ShawValuesTimeMajor":
            x, y = torch.randn(2, 6, 32, dtype=torch.float64), torch.randn(2, 9, 32, dtype=torch.float64)
            keep = torch.ones(2, 9, dtype=torch.bool)
            keep[0, 6:] = False
            mask = keep[:, None, None, :].long()
            got, want = m(x, y, y, mask), _out_want(name, m, x, y, keep[:, None, None, :])
        else:
            x = torch.randn(2, 6, 32, dtype=torch.float64)
            got, want = m(x), _out_want(name, m, x)
        assert torch.allclose(got, want, atol=1e-10)
        for bug in OUT_BUGS[name]:
            wrong = getattr(styles, name)(bug=bug).double()
            wrong.load_state_dict(m.state_dict())
            changed = wrong(x, y, y, mask) if name == "ShawValuesTimeMajor" else wrong(x)
            assert (changed - want).abs().max() > 1e-3, bug


@pytest.mark.parametrize("name", list(OUT_BUGS))
def test_a_term_on_the_output_is_the_modules_own(runner, name):
    result, out = trace(runner, f"{STYLES}:{name}", *OUT_ARGS[name])
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any(n.startswith("your code adds a term of its own to the attention's output") for n in out["notes"])
    rows = {row["reference"]: row["status"] for row in out["alignment"]}
    assert rows["x"] == "equal" and rows["attention"] == "equal", rows


NAMED = [("ShawKeysValues", "no_scale", "scale.none"), ("ShawKeysValues", "diagonal", "mask.off_by_one"),
         ("ShawValuesTimeMajor", "scale_hid", "scale.d_model"),
         ("ShawValuesTimeMajor", "fill_zero", "mask.filled_with_0"),
         ("PositionOutputBias", "softmax_dim", "softmax.axis"), ("KeyPositionValues", "softmax_dim", "softmax.axis")]


@pytest.mark.parametrize(("name", "bug", "entry"), NAMED, ids=[f"{n}-{b}" for n, b, _ in NAMED])
def test_mistakes_beside_the_output_term_are_named_by_experiment(runner, name, bug, entry):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug='{bug}'", *OUT_ARGS[name])
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == entry, first
    assert first["evidence"].startswith("by experiment"), first


# --- a bias added once the projection's output is cut apart ------------------------------------------------------

LATER = [("BiasAfterChunk", "no_scale", "scale.none"), ("HeadBiasAfterView", "softmax_dim", "softmax.axis")]


def test_biases_added_after_the_split_are_sdpa():
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    m = styles.BiasAfterChunk().double()
    q, k, v = F.linear(x, m.qkv.weight).split(32, -1)
    with torch.no_grad():
        assert torch.allclose(m(x), m.proj(_sdpa(q + m.q_bias, k, v + m.v_bias, 4)), atol=1e-10)
        h = styles.HeadBiasAfterView().double()
        q, k, v = (lin(x) + b.reshape(-1) for lin, b in ((h.w_q, h.b_q), (h.w_k, h.b_k), (h.w_v, h.b_v)))
        assert torch.allclose(h(x), h.w_o(_sdpa(q, k, v, 4)), atol=1e-10)
        for name, bug, _ in LATER:
            right = getattr(styles, name)().double()
            wrong = getattr(styles, name)(bug=bug).double()
            wrong.load_state_dict(right.state_dict())
            assert (wrong(x) - right(x)).abs().max() > 1e-3


@pytest.mark.parametrize(("name", "bug", "entry"), LATER, ids=[n for n, _, _ in LATER])
def test_a_bias_added_after_the_split_is_the_projections(runner, name, bug, entry):
    result, out = trace(runner, f"{STYLES}:{name}")
    assert result.exit_code == 0, result.stdout + result.stderr
    rows = {row["reference"]: row["status"] for row in out["alignment"]}
    assert rows["Q_split"] in ("equal", "permuted") and rows["x"] == "equal", rows
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == entry, out["first_divergence"]
