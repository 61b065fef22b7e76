"""`attnscope trace` on round 26's XLM and CTRL habits (tests/trace_styles_round26_xlm.py), each correct style checked
against F.scaled_dot_product_attention in float64 first:

- a mask parameter that takes a whole mask [bs, qlen, klen] as well as key padding [bs, klen] (XLM's `mask.dim() ==
  3`) is given the whole mask, the rule in it (masking.forms), never key padding with the rule handed to a
  `head_mask` that the code multiplies into its weights after the softmax (runs/trace_mask._rule_beside: such a
  parameter is no mask of scores; it was named mask.after_softmax by experiment on correct code);
- a decode cache kept as a dict read by keys of its own (`cache["length"]`, `cache[self.layer_idx]`) is handed one
  that answers them (usertrace/keyedcache.py), and a key trace cannot answer is said in one line, exit 2;
- a forward(value, key, query, .., past) without defaults gets a decode step, the new tokens to all three.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round26_xlm.py")
styles = user_module(STYLES)


def _heads(t, heads):
    b, n, c = t.shape
    return t.reshape(b, n, heads, c // heads).transpose(1, 2)


def _merged(t):
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


def _causal(n_q, n_k):
    """Lower-right causal, True = may attend."""
    return torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)


def test_the_keyed_cache_layer_is_causal_attention_with_its_cache():
    torch.manual_seed(0)
    m = styles.KeyedCacheLayer().double()
    x = torch.randn(2, 5, 48, dtype=torch.float64)
    k_old, v_old = torch.randn(2, 2, 4, 3, 12, dtype=torch.float64)
    q, k, v = (_heads(p(x), 4) for p in (m.query, m.key, m.value))
    keys, values = torch.cat([k_old, k], 2), torch.cat([v_old, v], 2)
    want = m.proj(_merged(F.scaled_dot_product_attention(q, keys, values, attn_mask=_causal(5, 8))))
    mask = _causal(5, 8).double().expand(2, 5, 8)
    cache = {"length": 3, m.layer_idx: (k_old, v_old)}
    torch.testing.assert_close(m(x, mask, cache=cache)[0], want)
    want = m.proj(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=_causal(5, 5))))
    torch.testing.assert_close(m(x, _causal(5, 5).double().expand(2, 5, 5))[0], want)


def test_the_three_input_layer_is_causal_attention_with_its_cache():
    torch.manual_seed(0)
    m = styles.ThreeInputLayer().double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    k_old, v_old = torch.randn(2, 2, 3, 4, 8, dtype=torch.float64)  # [bs, n, heads, d]
    q, k, v = (_heads(p(x), 4) for p in (m.w_query, m.w_key, m.w_value))
    keys, values = torch.cat([k_old.transpose(1, 2), k], 2), torch.cat([v_old.transpose(1, 2), v], 2)
    want = m.dense(_merged(F.scaled_dot_product_attention(q, keys, values, attn_mask=_causal(5, 8))))
    bias = torch.zeros(5, 8, dtype=torch.float64).masked_fill(~_causal(5, 8), float("-inf"))
    torch.testing.assert_close(m(x, x, x, bias, past=(k_old, v_old))[0], want)


def test_the_padding_layer_is_attention_over_its_real_keys():
    torch.manual_seed(0)
    m = styles.PaddingOnly().double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, 4:] = False
    q, k, v = m.qkv(x).view(2, 6, 3, 4, 8).permute(2, 0, 3, 1, 4)
    want = m.out(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])))
    torch.testing.assert_close(m(x, keep.double()), want)


CAUSAL, DECODE = ("--causal",), ("--causal", "--cache", "3")
CORRECT = [("KeyedCacheLayer", None, CAUSAL), ("KeyedCacheLayer", None, DECODE),
           ("ThreeInputLayer", None, CAUSAL), ("ThreeInputLayer", None, DECODE)]
PLANTS = [("KeyedCacheLayer", "bug='no_scale'", CAUSAL, "scale.none"),
          ("KeyedCacheLayer", "bug='merge_no_transpose'", CAUSAL, "heads.merge_without_transpose"),
          ("KeyedCacheLayer", "bug='cache_order'", DECODE, "cache.order"),
          ("ThreeInputLayer", "bug='cache_order'", DECODE, "cache.order"),
          ("ThreeInputLayer", "bug='no_scale'", DECODE, "scale.none")]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    for name, init, _, _ in PLANTS:
        good, bad = getattr(styles, name)(), getattr(styles, name)(bug=init.split("'")[1])
        bad.load_state_dict(good.state_dict())
        x = torch.randn(2, 5, 48 if name == "KeyedCacheLayer" else 32)
        if name == "KeyedCacheLayer":
            k_old, v_old = torch.randn(2, 2, 4, 3, 12)
            mask = _causal(5, 8).float().expand(2, 5, 8)
            outs = [m(x, mask, cache={"length": 3, m.layer_idx: (k_old, v_old)})[0] for m in (good, bad)]
        else:
            k_old, v_old = torch.randn(2, 2, 3, 4, 8)
            bias = torch.zeros(5, 8).masked_fill(~_causal(5, 8), float("-inf"))
            outs = [m(x, x, x, bias, past=(k_old, v_old))[0] for m in (good, bad)]
        assert (outs[0] - outs[1]).abs().max() > 1e-3, (name, init)


test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


def test_the_whole_mask_is_given_and_head_mask_left_none(runner):
    code, out = run_case(runner, STYLES, "KeyedCacheLayer", None, CAUSAL)
    notes = [" ".join(n.split()) for n in out["notes"]]
    assert code == 0 and any("runs on one shaped [n_batch, n_Q, n_K]" in n for n in notes), notes
    assert not any(n.startswith("head_mask: given") for n in notes), notes


def test_a_parameter_multiplied_after_the_softmax_never_takes_the_rule(runner):
    """Key padding alone, traced --causal: the rule has nowhere to go; head_mask (weights * head_mask) is no mask,
    so mask.after_softmax is never named by experiment on it."""
    code, out = run_case(runner, STYLES, "PaddingOnly", None, CAUSAL)
    notes = [" ".join(n.split()) for n in out["notes"]]
    assert not any(n.startswith("head_mask: given") for n in notes), notes
    found = out["first_divergence"]
    assert code == 1 and found is not None and found.get("experiment") != "mask.after_softmax", found


def test_the_keyed_cache_note_says_each_key(runner):
    code, out = run_case(runner, STYLES, "KeyedCacheLayer", None, DECODE)
    said = [" ".join(n.split()) for n in out["notes"] if "reads its cache as a dict keyed its own way" in n]
    assert code == 0 and said, out["notes"]
    assert "cache['length'] the number of cached positions" in said[0], said
    assert "(your module's layer_idx) the pair (K_cache, V_cache)" in said[0], said


def test_the_three_inputs_get_the_new_tokens(runner):
    code, out = run_case(runner, STYLES, "ThreeInputLayer", None, DECODE)
    notes = [" ".join(n.split()) for n in out["notes"]]
    assert code == 0 and any(n.startswith("key, value: handed query's tensor, the new tokens") for n in notes), notes


@pytest.fixture()
def unanswerable(tmp_path):
    """The keyed layer reading a key whose value it takes as a tensor (`.size(2)`) under a name that says neither keys
    nor values: no number of positions (the number handed has no size) nor a tensor trace can feed."""
    path = tmp_path / "keyed_other.py"
    path.write_text(Path(STYLES).read_text().replace('cache["length"]', 'cache["zork"].size(2)'))
    return str(path)


def test_a_key_trace_cannot_answer_is_said_in_one_line(runner, unanswerable):
    result, _ = trace(runner, f"{unanswerable}:KeyedCacheLayer", *DECODE)
    assert result.exit_code == 2, result.stdout + result.stderr
    said = " ".join(result.stderr.split())
    assert "your code reads cache['zork'] from its cache, which trace cannot feed" in said, said
    assert "Traceback" not in result.stderr
