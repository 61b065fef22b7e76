"""`attnscope trace` hands each parameter what the code takes, read from how the code uses it (round 16b:
Transformer-XL's `r`, Music Transformer's `[x, x, x]`, torchtune's `y` that raises when None, mistral-src's
`positions`, Flamingo's media [b, t, m, d], PatchTST's key_padding_mask beside attn_mask: each was 'your code
raised' on correct code, or the key padding and the rule went to one parameter). Styles of our own
(tests/trace_styles_round16_feeds.py), each checked against F.scaled_dot_product_attention in float64, each
plant shown to change the output and named by experiment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from trace_round14_helpers import heads, merged, moved, padding_file, planted

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round16_feeds.py")
styles = user_module(STYLES)
D, H, d = 32, 4, 8


def _sdpa(q, k, v, mask=None):  # [B, H, n, d] each; mask True = may attend, or an additive float
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _causal(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


def _bias(allowed):  # True = may attend -> 0 / -inf
    return torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))


def _differs(wrong, want):  # a plant's output: another number somewhere, or a row masked whole (NaN)
    return not torch.isfinite(wrong).all() or bool((wrong - want).abs().max() > 1e-2)


def _relative(q, rk, rr, index, scale):
    """The position term of Transformer-XL's attention, [B, H, n_Q, n_K]: (q_i + rr) · rk[index(i, j)], scaled
    (rk [n_r, H, d] or [n_r, B, H, d], rr [H, d]), -inf where the index falls outside the table."""
    b, h, n, _ = q.shape
    out = torch.full((b, h, n, n), float("-inf"), dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            at = index(i, j)
            if 0 <= at < rk.shape[0]:
                out[:, :, i, j] = ((q[:, :, i] + rr) * rk[at]).sum(-1) * scale  # rk[at]: [H, d] or [B, H, d]
    return out


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    n, b = 6, 2
    x = torch.randn(b, n, D, generator=g, dtype=torch.float64)
    causal = _causal(n)
    with torch.no_grad():
        # Transformer-XL, time-first: r [n, 1, D] holds distances n-1 .. 0
        xl = moved(styles.XLRelative())
        w, r = x.transpose(0, 1), torch.randn(n, 1, D, generator=g, dtype=torch.float64)
        q, k, v = (heads(t) for t in xl.qkv_net(x).chunk(3, -1))
        rk = xl.r_net(r[:, 0]).view(n, H, d)
        pos = _relative(q, rk, xl.r_r_bias, lambda i, j: n - 1 - (i - j), d ** -0.5)
        want = xl.o_net(merged(_sdpa(q + xl.r_w_bias[:, None], k, v, pos + _bias(causal))))
        got = xl(w, r, (~causal).to(torch.float64)[:, :, None]).transpose(0, 1)
        assert torch.allclose(got, want, atol=1e-10)
        for bug in ("scale_d_model", "values_from_keys"):
            wrong = planted(styles.XLRelative, xl, bug, w, r, (~causal).to(torch.float64)[:, :, None])
            assert (wrong.transpose(0, 1) - want).abs().max() > 1e-2

        # XLNet, time-first: r [2n, B, D] holds distances n .. -(n-1)
        xn = moved(styles.XLNetRelative())
        r2 = torch.randn(2 * n, b, D, generator=g, dtype=torch.float64)
        q, k, v = heads(xn.q(x)), heads(xn.k(x)), heads(xn.v(x))
        rk = xn.r(r2).view(2 * n, b, H, d)
        pos = _relative(q, rk, xn.r_r_bias, lambda i, j: n - (i - j), d ** -0.5)
        want = xn.o(merged(_sdpa(q + xn.r_w_bias[:, None], k, v, pos + _bias(causal))))
        assert torch.allclose(xn(w, r2, (~causal).to(torch.float64)).transpose(0, 1), want, atol=1e-10)
        wrong = planted(styles.XLNetRelative, xn, "scale_d_model", w, r2, (~causal).to(torch.float64))
        assert (wrong.transpose(0, 1) - want).abs().max() > 1e-2

        # a Conformer-like one, batch-first: rel [1, 2n-1, D] holds relative positions n-1 .. -(n-1)
        row = moved(styles.RowRelative())
        rel = torch.randn(1, 2 * n - 1, D, generator=g, dtype=torch.float64)
        q, k, v = heads(row.q(x)), heads(row.k(x)), heads(row.v(x))
        rk = row.p(rel[0]).view(2 * n - 1, H, d)
        pos = _relative(q, rk, row.w, lambda i, j: n - 1 - (i - j), d ** -0.5)
        want = row.o(merged(_sdpa(q + row.u[:, None], k, v, pos + _bias(causal))))
        assert torch.allclose(row(x, rel, causal), want, atol=1e-10)
        assert (planted(styles.RowRelative, row, "scale_d_model", x, rel, causal) - want).abs().max() > 1e-2

        def plain(m, allowed=causal):
            return m.o(merged(_sdpa(heads(m.q(x)), heads(m.k(x)), heads(m.v(x)), allowed)))

        # lists, a memory that must be given, positions not named so
        calls = {
            "IndexedList": lambda m: m([x, x, x], (~causal).to(torch.float64)),
            "UnpackedList": lambda m: m([x, x, x], causal),
            "KerasList": lambda m: m([x, x], causal.to(torch.float64)),
            "StreamingY": lambda m: m(x, x, mask=causal),
            "EncoderStates": lambda m: m(x, encoder_hidden_states=x),
            "ContextRequired": lambda m: m(x, x, causal),
            "RollingSteps": lambda m: m(x, torch.arange(n), _bias(causal)),
        }
        bugs = {"IndexedList": "merge", "UnpackedList": "softmax_axis", "KerasList": "no_scale",
                "StreamingY": "scale_d_model", "EncoderStates": "off_by_one", "ContextRequired": "merge",
                "RollingSteps": "softmax_axis"}
        for name, run in calls.items():
            cls = getattr(styles, name)
            ours = moved(cls())
            want = plain(ours)
            assert torch.allclose(run(ours), want, atol=1e-10), name
            wrong = cls(bug=bugs[name]).double().eval()
            wrong.load_state_dict(ours.state_dict())
            assert _differs(run(wrong), want), name

        steps = torch.arange(n)
        bucket = moved(styles.BucketedSteps())
        table = bucket.table[(steps[None, :] - steps[:, None]).clamp(-8, 8) + 8].permute(2, 0, 1)  # [H, n, n]
        want = bucket.o(merged(_sdpa(heads(bucket.q(x)), heads(bucket.k(x)), heads(bucket.v(x)),
                                     table + _bias(causal))))
        assert torch.allclose(bucket(x, steps, causal), want, atol=1e-10)
        assert (planted(styles.BucketedSteps, bucket, "no_scale", x, steps, causal) - want).abs().max() > 1e-2

        rope = moved(styles.RotaryOffsets())
        inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angle = torch.outer(steps.double(), inv)
        cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()

        def turned(t):
            return t * cos + torch.cat((-t[..., d // 2:], t[..., : d // 2]), -1) * sin

        want = rope.o(merged(_sdpa(turned(heads(rope.q(x))), turned(heads(rope.k(x))), heads(rope.v(x)), causal)))
        assert torch.allclose(rope(x, steps, causal), want, atol=1e-10)
        assert (planted(styles.RotaryOffsets, rope, "rope_on_values", x, steps, causal) - want).abs().max() > 1e-2

        # a memory of groups of tokens [B, t, m, D]
        media = moved(styles.GroupedMedia())
        y = torch.randn(b, 2, 3, D, generator=g, dtype=torch.float64)
        q, (k, v) = heads(media.to_q(x)), (heads(t) for t in media.to_kv(y.flatten(1, 2)).chunk(2, -1))
        want = media.to_out(merged(_sdpa(q, k, v)))
        assert torch.allclose(media(x, y), want, atol=1e-10)
        assert (planted(styles.GroupedMedia, media, "kv_swapped", x, y) - want).abs().max() > 1e-2

        # two mask parameters, each its part: key padding [B, n_K] beside the causal rule
        keep = torch.ones(b, n, dtype=torch.bool)
        keep[0, 4:] = False
        both = causal & keep[:, None, None, :]
        pairs = {
            "FairseqPair": lambda m: m(x, key_padding_mask=~keep, attn_mask=_bias(causal)),
            "MergedPair": lambda m: m(x, attn_mask=~causal, key_padding_mask=~keep),
            "KeepPair": lambda m: m(x, mask=causal, padding_mask=keep.to(torch.float64)),
        }
        for name, run in pairs.items():
            cls = getattr(styles, name)
            ours = moved(cls())
            want = plain(ours, both)
            assert torch.allclose(run(ours), want, atol=1e-10), name
            wrong = cls(bug="padding_on_queries").double().eval()
            wrong.load_state_dict(ours.state_dict())
            assert _differs(run(wrong), want), name


# (style, its flags, what the note says it was handed)
CORRECT = [
    ("XLRelative", ("--causal",), "relative, time-first position embedding [n_Q, 1, d_feat]"),
    ("XLNetRelative", ("--causal",), "relative, time-first, both ways position embedding"),
    ("RowRelative", ("--causal",), "relative position embedding [1, 2·n_Q-1, d_feat]"),
    ("IndexedList", ("--causal",), "a list of 3, each the input itself"),
    ("UnpackedList", ("--causal",), "a list of 3, each the input itself"),
    ("KerasList", ("--causal",), "a list of 2, each the input itself"),
    ("StreamingY", ("--causal",), "runs with y = x, the same tensor"),
    ("EncoderStates", ("--causal",), "runs with encoder_hidden_states = hidden_states, the same tensor"),
    ("ContextRequired", ("--causal",), "runs with context = x, the same tensor"),
    ("RollingSteps", ("--causal",), "the tokens' positions, torch.arange(n_Q)"),
    ("BucketedSteps", ("--causal",), "the tokens' positions, torch.arange(n_Q)"),
    ("RotaryOffsets", ("--causal", "--rope"), "the tokens' positions, torch.arange(n_Q)"),
]


@pytest.mark.parametrize(("name", "args", "said"), CORRECT, ids=[c[0] for c in CORRECT])
def test_a_parameter_gets_what_its_use_reads(runner, name, args, said):
    result, out = trace(runner, f"{STYLES}:{name}", *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any(said in n for n in out["notes"]), out["notes"]


PAIRS = [("FairseqPair", "attn_mask", "key_padding_mask"), ("MergedPair", "attn_mask", "key_padding_mask"),
         ("KeepPair", "mask", "padding_mask")]


@pytest.mark.parametrize(("name", "rule", "padding"), PAIRS, ids=[p[0] for p in PAIRS])
def test_key_padding_and_the_rule_go_each_to_its_parameter(runner, tmp_path, name, rule, padding):
    pad = padding_file(tmp_path, 5)
    result, out = trace(runner, f"{STYLES}:{name}", "--causal", "--mask", pad)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any(n.startswith(f"{rule}: given the causal rule") and f"key padding {padding} takes" in n
               for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:{name}", "--causal", "--mask", pad, "--init", "bug='padding_on_queries'")
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == "mask.on_queries" and first["evidence"].startswith("by experiment"), first


BUGS = [("XLRelative", "scale_d_model", ("--causal",), "scale.d_model"),
        ("XLRelative", "values_from_keys", ("--causal",), "kv.values_from_keys"),
        ("XLNetRelative", "scale_d_model", ("--causal",), "scale.d_model"),
        ("RowRelative", "scale_d_model", ("--causal",), "scale.d_model"),
        ("IndexedList", "merge", ("--causal",), "heads.merge_without_transpose"),
        ("UnpackedList", "softmax_axis", ("--causal",), "softmax.axis"),
        ("KerasList", "no_scale", ("--causal",), "scale.none"),
        ("StreamingY", "scale_d_model", ("--causal",), "scale.d_model"),
        ("EncoderStates", "off_by_one", ("--causal",), "mask.off_by_one"),
        ("RollingSteps", "softmax_axis", ("--causal",), "softmax.axis"),
        ("RotaryOffsets", "rope_on_values", ("--causal", "--rope"), "rope.on_values")]


@pytest.mark.parametrize(("name", "bug", "args", "entry"), BUGS, ids=[f"{b[0]}-{b[1]}" for b in BUGS])
def test_mistakes_after_the_reading_are_named_by_experiment(runner, name, bug, args, entry):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug={bug!r}", *args)
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == entry and first["evidence"].startswith("by experiment"), first


def test_a_memory_read_as_groups_of_tokens_gets_one_group(runner):
    """Flamingo's media [b, t, m, d] (`b, t, m = media.shape[:3]`, then media.shape[3]): handed [n_batch, 1, n_K,
    d_feat], the same keys the reference reads (was: 'your code raised: IndexError')."""
    result, out = trace(runner, f"{STYLES}:GroupedMedia", "--nq", "5", "--nk", "6")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any("runs on [n_batch, 1, n_K, d_feat]" in n for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:GroupedMedia", "--nq", "5", "--nk", "6", "--init", "bug='kv_swapped'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "kv.swapped", out["first_divergence"]
