"""`attnscope trace` reads keys and values projected part by part and joined after their projection, a prefix then
the queries' own tokens (Perceiver AR's causal prefix attention, usertrace/prefixkeys.py): the reference took the
prefix alone as its keys ("none of your tensors has scores's shape"), a false alarm with every plant behind it. Its
keys and values now read the parts' inputs joined in the code's order, n_K their length, a lower-right causal rule
aligned over them and a key padding of the prefix laid over the joined keys; heads processed a few at a time no
longer read as a projection's rows beside a gate (widerows.py), which refused a plant ("4 query heads cannot share 8
key/value heads evenly"). Styles of our own (tests/trace_styles_round25_prefixkeys.py), each checked against
F.scaled_dot_product_attention in float64."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round25_prefixkeys.py")
styles = user_module(STYLES)
CAUSAL = ("--causal", "lower-right")


def _attend(q, k, v, heads, allowed):
    """[B, n, D] each: F.scaled_dot_product_attention over the heads, `allowed` [.., n_Q, n_K] True = may attend."""
    B, N, D = q.shape
    q, k, v = (t.reshape(B, t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).reshape(B, N, D)


def _lower_right(n_q, n_k):
    return torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)


def test_the_styles_are_causal_attention_over_the_prefix_and_the_tokens():
    torch.manual_seed(0)
    x, context = torch.randn(2, 5, 24, dtype=torch.float64), torch.randn(2, 6, 24, dtype=torch.float64)
    padding = torch.ones(2, 6, dtype=torch.bool)
    padding[0, 1:3] = False
    m = styles.ChunkedPrefix().double()
    xn, cn = m.norm(x), m.context_norm(context)
    joined = torch.cat([cn, xn], dim=1)
    k, v = m.to_kv(joined).chunk(2, dim=-1)
    allowed = _lower_right(5, 11) & torch.cat([padding, torch.ones(2, 5, dtype=torch.bool)], 1)[:, None, None, :]
    torch.testing.assert_close(m(x, context, padding), m.to_out(_attend(m.to_q(xn), k, v, 4, allowed)))
    x, prefix = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 6, 32, dtype=torch.float64)
    m = styles.SplitJoinedPrefix().double()
    joined = torch.cat([m.prefix_norm(prefix), m.input_norm(x)], dim=1)
    out = _attend(m.q_proj(m.input_norm(x)), m.k_proj(joined), m.v_proj(joined), 4, _lower_right(5, 11))
    torch.testing.assert_close(m(x, prefix), m.o_proj(out))
    x, memory = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 6, 16, dtype=torch.float64)
    m = styles.FoldedPrefix().double()
    joined = torch.cat([memory, x], dim=1)
    out = _attend(F.linear(x, m.wq), F.linear(joined, m.wk), F.linear(joined, m.wv), 2, _lower_right(5, 11))
    torch.testing.assert_close(m(x, memory), F.linear(out, m.wo))


PLANTS = [("ChunkedPrefix", "bug='no_scale'", CAUSAL, "scale.none"),
          ("ChunkedPrefix", "bug='upper_left'", CAUSAL, "mask.upper_left"),
          ("ChunkedPrefix", "bug='merge_wrong'", CAUSAL, "heads.merge_wrong_permute"),
          ("SplitJoinedPrefix", "bug='off_by_one'", CAUSAL, "mask.off_by_one"),
          ("SplitJoinedPrefix", "bug='no_scale'", CAUSAL, "scale.none"),
          ("FoldedPrefix", "bug='off_by_one'", CAUSAL, "mask.off_by_one"),
          ("FoldedPrefix", "bug='no_scale'", CAUSAL, "scale.none")]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    for name, init, _, _ in PLANTS:
        good, bad = getattr(styles, name)(), getattr(styles, name)(bug=init.split("'")[1])
        width = next(p.shape[-1] for p in good.parameters() if p.dim() == 2)
        x, prefix = torch.randn(2, 5, width), torch.randn(2, 6, width)
        assert (good(x, prefix) - bad(x, prefix)).abs().max() > 1e-3, (name, init)


CORRECT = [("ChunkedPrefix", None, CAUSAL), ("SplitJoinedPrefix", None, CAUSAL), ("FoldedPrefix", None, CAUSAL)]
test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


def test_the_note_and_the_words_say_the_joined_keys(runner):
    code, out = run_case(runner, STYLES, "ChunkedPrefix", options=CAUSAL)
    said = [" ".join(n.split()) for n in out["notes"] if n.startswith("your keys and values are projected part")]
    assert code == 0 and said and "n_K = 16 where your keys' input has 9" in said[0], out["notes"]
    code, out = run_case(runner, STYLES, "ChunkedPrefix", "bug='upper_left'", CAUSAL)
    assert code == 1 and "last of 16 keys" in " ".join(out["first_divergence"]["diagnosis"].split())
