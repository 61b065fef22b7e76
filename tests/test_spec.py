"""spec.py: the one description of the attention asked for. Checked once, read by every consumer; its errors name
the parameter for a Python caller and the flag on the command line; a decode step aligns lower-right."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from attnscope import MultiHeadAttention, sdpa
from attnscope.cli import app
from attnscope.errors import UsageError
from attnscope.spec import AttentionSpec


@pytest.mark.parametrize(("kwargs", "align"), [
    ({}, None), ({"causal": True}, "upper-left"), ({"causal": "lower-right"}, "lower-right"),
    ({"window": 3}, "upper-left"), ({"window": 3, "cache": 2}, "lower-right"), ({"causal": True, "cache": 2},
                                                                                "lower-right"),
    ({"cache": 2}, None),  # a decode step need not be causal (cross-attention over a cache)
])
def test_the_alignment_is_resolved_once(kwargs, align):
    assert AttentionSpec(**kwargs).align == align


@pytest.mark.parametrize(("kwargs", "python", "flag"), [
    ({"window": 0}, "window 0: a query must see at least itself", "--window 0: a query must see at least itself"),
    ({"softcap": -1.0}, "softcap -1: the cap must be a positive number", "--softcap -1: the cap"),
    ({"scale": float("nan")}, "scale nan: the scores' scale must be a finite number", "--scale nan"),
    ({"cache": -1}, "cache -1: the number of cached positions", "--cache -1"),
    ({"cache": 3, "causal": "upper-left"}, "drop causal upper-left", "drop --causal upper-left"),
    ({"causal": "sideways"}, "causal='sideways'", "--causal='sideways'"),
])
def test_errors_name_the_parameter_and_the_cli_words_it_as_a_flag(kwargs, python, flag):
    from attnscope.cli.errors import FLAGS

    with pytest.raises(UsageError) as caught:
        AttentionSpec(**kwargs)
    assert python in str(caught.value) and "--" not in str(caught.value)
    assert flag in caught.value.worded(FLAGS)


@pytest.mark.parametrize(("args", "line"), [
    (["sdpa", "--nq", "3", "--nk", "4", "--pad", "4"], "--pad 4 must hide fewer keys than there are (n_K = 4)"),
    (["mha", "--heads", "8", "--kv-heads", "3", "--d-feat", "16"], "--heads 8 is not a multiple of --kv-heads 3"),
    (["sdpa", "--softcap", "-2"], "--softcap -2: the cap must be a positive number (Gemma 2 uses 50)"),
    (["mask", "--nq", "2", "--cache", "3", "--causal", "upper-left"], "drop --causal upper-left"),
])
def test_the_command_line_says_flags(runner, args, line):
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and line in result.stderr, result.stderr


def test_spec_and_keywords_are_not_both_given():
    Q = torch.randn(2, 3, 4)
    with pytest.raises(UsageError, match="not both"):
        sdpa(Q, Q, Q, causal=True, spec=AttentionSpec(window=2))
    with pytest.raises(UsageError, match="not both"):
        MultiHeadAttention(8, 2, window=2, spec=AttentionSpec())


@pytest.mark.parametrize("kwargs", [{"causal": True}, {"window": 3}, {"causal": "lower-right"}])
def test_a_decode_step_of_the_python_api_aligns_lower_right(kwargs):
    """issue 18: with a cache, the new queries sit after the cached positions for the mask as for RoPE."""
    torch.manual_seed(0)
    n_cache, n_new = 4, 2
    module = MultiHeadAttention(16, 2, bias=False, **kwargs).eval()
    K_cache, V_cache = torch.randn(1, 2, n_cache, 8), torch.randn(1, 2, n_cache, 8)
    X = torch.randn(1, n_new, 16)
    with torch.no_grad():
        trace = module(X, cache=(K_cache, V_cache))
        q = module.W_q(X).view(1, n_new, 2, 8).transpose(1, 2)
        k = torch.cat([K_cache, module.W_k(X).view(1, n_new, 2, 8).transpose(1, 2)], dim=-2)
        v = torch.cat([V_cache, module.W_v(X).view(1, n_new, 2, 8).transpose(1, 2)], dim=-2)
        n_K = n_cache + n_new
        if "window" in kwargs:  # query i at position n_cache + i sees keys j with p - 3 < j <= p
            p = torch.arange(n_new)[:, None] + n_cache
            j = torch.arange(n_K)
            expected = F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= p) & (p - j < 3))
        else:
            expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n_new, n_K))
    torch.testing.assert_close(trace["x_raw"], expected)
    assert bool(trace["attention"][0, 0, 0, n_cache]), "query 0 of the step sees the key at its own position"


def test_a_decode_step_refuses_explicit_upper_left():
    module = MultiHeadAttention(8, 2, causal="upper-left")
    cache = (torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    with pytest.raises(UsageError, match="cache 3 puts the queries after 3 cached positions"):
        module(torch.randn(1, 1, 8), cache=cache)


@pytest.mark.parametrize("spec", [AttentionSpec(window=4, window_side="both"), AttentionSpec(), AttentionSpec(
    causal=True), AttentionSpec(window=3), AttentionSpec(chunk=4), AttentionSpec(alibi=True)])
def test_a_block_of_rows_is_those_rows_of_the_whole(spec):
    """`rows_from(a)`: rows a.. of a longer sequence's queries, over the keys they may see (a causal block is a decode
    step after a positions, keys 0..b-1; any other block reads every key, its queries at positions a..): the rows
    of the whole pattern, for windows on either side, chunks and ALiBi, against F.scaled_dot_product_attention."""
    from attnscope.masks import structural

    torch.manual_seed(0)
    n, a, b = 12, 5, 9
    Q, K, V = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
    whole = sdpa(Q, K, V, spec=spec)["attention"]
    keys = b if spec.align is not None else n
    block = sdpa(Q[..., a:b, :], K[..., :keys, :], V[..., :keys, :], spec=spec.rows_from(a))["attention"]
    torch.testing.assert_close(block, whole[..., a:b, :keys])
    if not spec.alibi:
        allowed, _ = structural(spec, n, n)
        mask = None if allowed is None else allowed[a:b, :keys]
        expected = F.scaled_dot_product_attention(Q[..., a:b, :], K[..., :keys, :], V[..., :keys, :], attn_mask=mask)
        torch.testing.assert_close(sdpa(Q[..., a:b, :], K[..., :keys, :], V[..., :keys, :],
                                        spec=spec.rows_from(a))["out"], expected)


def test_start_is_for_bidirectional_rows_only():
    with pytest.raises(UsageError, match="a causal block of rows is a decode step"):
        AttentionSpec(causal=True, start=3)
    with pytest.raises(UsageError, match="cannot be negative"):
        AttentionSpec(start=-1)
