"""`attnscope trace`: what it feeds a forward, read from what the code does with each argument (issue 41, round 7;
styles in docs/examples/fed_styles.py, which docs/trace.md runs).

- A parameter the code multiplies its attention weights by after the softmax (transformers' `head_mask`) is no mask:
  it gets None, and the code's own mask is compared; a plain `mask` so multiplied, the code's only mask, is the
  `mask.after_softmax` mistake. `--forward "head_mask=None"` is accepted.
- A mask the code raised on is given laid out as the scores it met: `[b, n_Q, 1, n_K]` for multi-query scores
  `[b, n_Q, n_head, n_K]`, `[b, n_Q, n_K, 1]` for heads last, `[n_q, n_k]` for a column-form function's Qᵀ K.
- Sequence lengths (`valid_lens`, `lengths`, `seq_lens`) are key padding where the code compares them with an arange
  over the keys: None where nothing is masked, `[n_batch]` from a padding file, `[n_batch, n_Q]` for --causal.
- RoPE's tables: a module that makes its own (`position_embeddings=None`) makes them, of its config's base and share;
  tables trace makes are as wide as the share the code rotates (its config's, or the width its code slices) and of
  the base its config says, the config --init hands an __init__ that does not keep it included.

Each correct style is checked apart from attnscope against F.scaled_dot_product_attention (or a float64 RoPE) holding
its weights, and each planted bug changes its output."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from tracecases import run_case

STYLES = str(Path(__file__).resolve().parent.parent / "docs" / "examples" / "fed_styles.py")
styles = user_module(STYLES)
torch.manual_seed(0)
X = torch.randn(2, 6, 32)


def _run(runner, target: str, *args: str) -> tuple[int, dict]:
    return run_case(runner, STYLES, target, options=args)


def _heads(t: torch.Tensor, n: int) -> torch.Tensor:
    b, s, _ = t.shape
    return t.view(b, s, n, -1).transpose(1, 2)


def _merge(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)


def _sdpa(x, q_proj, k_proj, v_proj, o_proj, n_head: int, mask=None, causal=False) -> torch.Tensor:
    q, k, v = (_heads(p(x), n_head) for p in (q_proj, k_proj, v_proj))
    return o_proj(_merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)))


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return not torch.allclose(a, b, atol=1e-4)


# --- the styles against references that share no code with attnscope ------------------------------------------


def test_styles_match_sdpa_and_each_bug_changes_them():
    with torch.no_grad():
        m = styles.HeadMaskedSelfAttention()
        want = _sdpa(X, m.query, m.key, m.value, m.dense, 4, causal=True)
        torch.testing.assert_close(m(X, head_mask=None), want, atol=1e-5, rtol=1e-5)
        for bug in ("scale_d_model", "fill_zero"):
            assert _differs(styles.HeadMaskedSelfAttention(bug=bug)(X), want)
        m = styles.LayerHeadMaskAttention()
        want = _sdpa(X, m.q_proj, m.k_proj, m.v_proj, m.out_proj, 4, causal=True)
        torch.testing.assert_close(m(X), want, atol=1e-5, rtol=1e-5)
        assert _differs(styles.LayerHeadMaskAttention(bug="scaled_twice")(X), want)
        q, k, v = torch.randn(3, 2, 4, 6, 8).unbind(0)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(styles.head_weighted_attention(q, k, v), want, atol=1e-5, rtol=1e-5)
        assert _differs(styles.head_weighted_softmax_axis(q, k, v), want)

        m = styles.MultiQueryAttention()
        e, dh = 32, 8
        weights, biases = m.c_attn.weight.split((e, dh, dh)), m.c_attn.bias.split((e, dh, dh))
        q = _heads(F.linear(X, weights[0], biases[0]), 4)
        k, v = (F.linear(X, w, b)[:, None].expand(-1, 4, -1, -1) for w, b in zip(weights[1:], biases[1:],
                                                                                 strict=True))
        want = m.c_proj(_merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, :, None, :]  # [b, n_Q, 1, n_K]
        torch.testing.assert_close(m(X, causal), want, atol=1e-5, rtol=1e-5)
        for bug in ("values_from_keys", "unscaled"):
            assert _differs(styles.MultiQueryAttention(bug=bug)(X, causal), want)
        m = styles.HeadsLastAttention()
        want = _sdpa(X, m.to_q, m.to_k, m.to_v, m.to_out, 4, causal=True)
        heads_last = torch.ones(6, 6, dtype=torch.bool).tril()[None, :, :, None]  # [b, n_Q, n_K, 1]
        torch.testing.assert_close(m(X, heads_last), want, atol=1e-5, rtol=1e-5)
        assert _differs(styles.HeadsLastAttention(bug="softmax_axis")(X, heads_last), want)
        Q, K, V = torch.randn(8, 5), torch.randn(8, 7), torch.randn(10, 7)  # one token a column
        rule = torch.ones(5, 7, dtype=torch.bool).tril()
        want = F.scaled_dot_product_attention(Q.T, K.T, V.T, attn_mask=rule).T
        torch.testing.assert_close(styles.column_attention(Q, K, V, rule), want, atol=1e-5, rtol=1e-5)
        assert _differs(styles.column_attention_scale_twice(Q, K, V, rule), want)

        lengths = torch.tensor([4, 6])
        padding = (torch.arange(6)[None, :] < lengths[:, None])[:, None, None, :]  # [b, 1, 1, n_K]
        m = styles.LengthsAttention()
        want = _sdpa(X, m.W_q, m.W_k, m.W_v, m.W_o, 4, mask=padding)
        torch.testing.assert_close(m(X, X, X, lengths), want, atol=1e-5, rtol=1e-5)
        assert _differs(styles.LengthsAttention(bug="fill_zero")(X, X, X, lengths), want)
        q, k, v = torch.randn(3, 2, 6, 8).unbind(0)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=padding[:, 0])
        torch.testing.assert_close(styles.lengths_attention(q, k, v, lengths), want, atol=1e-5, rtol=1e-5)
        assert _differs(styles.lengths_attention_polarity(q, k, v, lengths), want)
        m = styles.SeqLensSelfAttention()
        wq, wk, wv = m.in_proj.weight.chunk(3)
        bq, bk, bv = m.in_proj.bias.chunk(3)
        q, k, v = (_heads(F.linear(X, w, b), 4) for w, b in ((wq, bq), (wk, bk), (wv, bv)))
        want = m.out_proj(_merge(F.scaled_dot_product_attention(q, k, v, attn_mask=padding)))
        torch.testing.assert_close(m(X, lengths), want, atol=1e-5, rtol=1e-5)
        assert _differs(styles.SeqLensSelfAttention(bug="on_queries")(X, lengths), want)


def _rope(t: torch.Tensor, rotated: int, base: float, interleaved: bool = False) -> torch.Tensor:
    """The first `rotated` coordinates of each head turned by RoPE in float64 (half-split, or interleaved)."""
    n = t.shape[-2]
    inv = 1.0 / base ** (torch.arange(0, rotated, 2, dtype=torch.float64) / rotated)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * inv  # [n, rotated / 2]
    x = t[..., :rotated].double()
    if interleaved:
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        turned = torch.stack((a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()), -1).flatten(-2)
    else:
        a, b = x[..., : rotated // 2], x[..., rotated // 2:]
        turned = torch.cat((a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()), -1)
    return torch.cat((turned.to(t.dtype), t[..., rotated:]), -1)


def test_rope_styles_match_a_float64_rope_and_each_bug_changes_them():
    with torch.no_grad():
        config = styles.RotaryConfig()
        m = styles.PartialRotaryAttention(config)
        q, k, v = (_heads(p(X), 4) for p in (m.q_proj, m.k_proj, m.v_proj))
        want = m.o_proj(_merge(F.scaled_dot_product_attention(_rope(q, 4, 50000.0), _rope(k, 4, 50000.0), v)))
        torch.testing.assert_close(m(X), want, atol=1e-5, rtol=1e-5)
        for bug in ("default_base", "freqs_whole_head"):
            assert _differs(styles.PartialRotaryAttention(config, bug=bug)(X), want)
        m = styles.GivenTablesAttention(config)
        inv = 1.0 / 50000.0 ** (torch.arange(0, 4, 2).float() / 4)
        emb = torch.cat([torch.outer(torch.arange(6).float(), inv)] * 2, -1)[None].expand(2, -1, -1)
        q, k, v = m.query_key_value(X).view(2, 6, 4, 24).transpose(1, 2).chunk(3, dim=-1)
        want = m.dense(_merge(F.scaled_dot_product_attention(_rope(q, 4, 50000.0), _rope(k, 4, 50000.0), v,
                                                             is_causal=True)))
        torch.testing.assert_close(m(X, (emb.cos(), emb.sin())), want, atol=1e-5, rtol=1e-5)
        assert _differs(styles.GivenTablesAttention(config, bug="pairing")(X, (emb.cos(), emb.sin())), want)
        x = torch.randn(2, 6, 64)
        m = styles.SlicedTablesAttention()
        inv = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8)
        emb = torch.cat([torch.outer(torch.arange(6).float(), inv)] * 2, -1)
        q, k, v = (_heads(w(x), 4) for w in (m.wq, m.wk, m.wv))
        want = m.wo(_merge(F.scaled_dot_product_attention(_rope(q, 8, 1e4), _rope(k, 8, 1e4), v, is_causal=True)))
        torch.testing.assert_close(m(x, emb.cos(), emb.sin()), want, atol=1e-5, rtol=1e-5)
        assert _differs(styles.SlicedTablesAttention(bug="pairing")(x, emb.cos(), emb.sin()), want)
        args = styles.ModelArgs(rope_base=500000)
        m = styles.ArgsRopeAttention(args)
        q, k, v = (t.view(2, 6, 4, 8).transpose(1, 2) for t in m.wqkv(X).split(32, dim=-1))
        rotated = (_rope(t, 8, 500000.0, interleaved=True) for t in (q, k))
        want = m.wo(_merge(F.scaled_dot_product_attention(*rotated, v, is_causal=True)))
        torch.testing.assert_close(m(X), want, atol=1e-5, rtol=1e-5)
        assert _differs(styles.ArgsRopeAttention(args, bug="forgot_base")(X), want)


# --- what trace makes of them ----------------------------------------------------------------------------------

CLEAN = [
    ("HeadMaskedSelfAttention", ("--causal",), "head_mask: your code multiplies its attention weights by it"),
    ("LayerHeadMaskAttention", ("--causal",), "layer_head_mask: your code multiplies its attention weights by it"),
    ("head_weighted_attention", ("--causal", "--heads", "4"), "head_mask: your code multiplies"),
    ("MultiQueryAttention", ("--causal",), "[n_batch, n_Q, 1, n_K], as the scores it meets"),
    ("HeadsLastAttention", ("--causal",), "[n_batch, n_Q, n_K, 1], as the scores it meets"),
    ("column_attention", ("--causal",), "[n_Q, n_K], as the scores it meets"),
    ("LengthsAttention", (), "valid_lens = None"),
    ("LengthsAttention", ("--causal",), "given [n_batch, n_Q]"),
    ("PartialRotaryAttention", ("--init", "config=RotaryConfig()", "--rope", "--causal"),
     "position_embeddings = None: your module makes RoPE's tables itself"),
    ("GivenTablesAttention", ("--init", "config=RotaryConfig()", "--rope", "--causal"),
     "RoPE base 50000, read from your module"),
    ("SlicedTablesAttention", ("--rope", "--causal"), "it rotates the first 8 of each head's 16 coordinates"),
    ("ArgsRopeAttention", ("--init", "config=ModelArgs(rope_base=500000)", "--rope", "--causal"),
     "RoPE base 500000, read from your module"),
]


@pytest.mark.parametrize("target, args, said", CLEAN, ids=[f"{c[0]}{len(c[1])}" for c in CLEAN])
def test_correct_code_is_fed_as_it_reads_its_arguments(runner, target, args, said):
    code, out = _run(runner, target, *args)
    assert code == 0 and out["first_divergence"] is None, (out["first_divergence"], out["notes"])
    assert any(said in note for note in out["notes"]), out["notes"]


@pytest.fixture(scope="module")
def padding(tmp_path_factory) -> tuple[str, ...]:
    keep = torch.ones(2, 6, dtype=torch.bool)  # [n_batch, n_K]: keys 4 and 5 of the first sequence padded
    keep[0, 4:] = False
    path = tmp_path_factory.mktemp("pad") / "pad.pt"
    torch.save(keep, path)
    return ("--mask", str(path), "--batch", "2", "--nq", "6")


BUGS = [
    ("HeadMaskedSelfAttention", "scale_d_model", ("--causal",), "scale.d_model"),
    ("HeadMaskedSelfAttention", "fill_zero", ("--causal",), "mask.filled_with_0"),
    ("LayerHeadMaskAttention", "scaled_twice", ("--causal",), "scale.twice"),
    ("MultipliedAfterSoftmax", None, ("--causal",), "mask.after_softmax"),
    ("MultiQueryAttention", "values_from_keys", ("--causal",), "kv.values_from_keys"),
    ("column_attention_scale_twice", None, ("--causal",), "scale.twice"),
    ("LengthsAttention", "fill_zero", ("PAD",), "mask.filled_with_0"),
    ("lengths_attention_polarity", None, ("PAD",), "mask.polarity"),
    ("SeqLensSelfAttention", "on_queries", ("PAD",), "mask.on_queries"),
    ("PartialRotaryAttention", "default_base", ("--init", "config=RotaryConfig()", "--rope", "--causal"), "rope.base"),
    ("PartialRotaryAttention", "freqs_whole_head", ("--init", "config=RotaryConfig()", "--rope", "--causal"),
     "rope.fraction"),
    ("SlicedTablesAttention", "pairing", ("--rope", "--causal"), "rope.pairing"),
    ("ArgsRopeAttention", "forgot_base", ("--init", "config=ModelArgs(rope_base=500000)", "--rope", "--causal"),
     "rope.base"),
]


@pytest.mark.parametrize("target, bug, args, entry", BUGS, ids=[f"{b[0]}-{b[1]}" for b in BUGS])
def test_planted_bugs_are_named_by_experiment(runner, padding, target, bug, args, entry):
    args = padding if args == ("PAD",) else args
    if bug is not None:
        init = f"bug='{bug}'"
        if "--init" in args:
            at = args.index("--init") + 1
            args = (*args[:at], f"{args[at]}, {init}", *args[at + 1:])
        else:
            args = (*args, "--init", init)
    code, out = _run(runner, target, *args)
    assert code == 1, (out["notes"], out.get("failure"))
    assert out["first_divergence"]["experiment"] == entry, out["first_divergence"]


def test_lengths_carry_a_padding_file_and_refuse_a_window(runner, padding):
    code, out = _run(runner, "LengthsAttention", *padding)
    assert code == 0 and out["first_divergence"] is None, out["first_divergence"]
    assert any("valid_lens: sequence lengths" in n and "given [n_batch] = [4, 6]" in n for n in out["notes"])
    result, _ = trace(runner, f"{STYLES}:LengthsAttention", "--window", "2")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "valid_lens takes sequence lengths" in result.stderr and "--mask FILE" in result.stderr


def test_forward_gives_a_mask_parameter_and_a_parameter_without_default(runner):
    code, out = _run(runner, "HeadMaskedSelfAttention", "--causal", "--init", "bug='fill_zero'",
                     "--forward", "head_mask=None")
    assert code == 1 and out["first_divergence"]["experiment"] == "mask.filled_with_0", out["first_divergence"]
    assert "--forward: head_mask=None" in out["notes"]
    code, out = _run(runner, "LengthsAttention", "--forward", "valid_lens=None")
    assert code == 0 and out["first_divergence"] is None, out["first_divergence"]


def test_a_fourth_parameter_the_code_does_not_compare_with_keys_is_still_refused(runner, tmp_path):
    path = tmp_path / "four.py"
    path.write_text("import torch\n\ndef attention(q, k, v, temperature):\n    return (q @ k.transpose(-2, -1) / "
                    "temperature).softmax(-1) @ v\n")
    result, _ = trace(runner, f"{path}:attention")
    assert result.exit_code == 2, result.output
    assert "its parameters without a default are q, k, v, temperature" in result.stderr


def test_math_of_the_lengths_written():
    from attnscope.usertrace import lengths

    causal = torch.ones(3, 5, dtype=torch.bool).tril()[None]
    counts, allowed = lengths.written(causal, 2, "valid_lens")
    assert counts.tolist() == [[1, 2, 3]] * 2 and allowed.shape == (2, 1, 3, 5)
    keys = torch.tensor([[True] * 3 + [False] * 2, [True] * 5])[:, None, None, :]
    counts, allowed = lengths.written(keys, 2, "valid_lens")
    assert counts.tolist() == [3, 5] and torch.equal(allowed, keys)
    assert math.isclose(float(counts.float().mean()), 4.0)
