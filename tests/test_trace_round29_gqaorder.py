"""`attnscope trace` names gqa.tiled where the code lays its key/value heads out wrong on the keys' side, by whatever op
(round 29's ChatGLM: `unsqueeze(-3).expand(..).contiguous().view(..)` time-first, named gqa.group_order with words
about a grouped einsum over q, because only a reshape straight after an expand counted as a repeat), and
gqa.group_order where no op widens the keys (a grouped einsum over q). The two compute the same numbers; the code's
data flow picks (usertrace/kvrepeat.py), and gqa.tiled's words name the op the code wrote. Styles of our own
(tests/trace_styles_round29_gqaorder.py), each correct one checked against F.scaled_dot_product_attention in float64
with the key/value heads repeated by transformers' repeat_kv; each plant shown to change the output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, case_ids, run_case
from transformers.models.llama.modeling_llama import repeat_kv

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round29_gqaorder.py")
styles = user_module(STYLES)


def _sdpa(q, k, v, causal):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, g), repeat_kv(v, g), is_causal=causal)


def _same(cls, m, **init):
    planted = cls(**init)
    planted.load_state_dict(m.state_dict())
    return planted.double()


def test_the_styles_are_grouped_query_sdpa():
    x = torch.randn(5, 2, 32, dtype=torch.float64)  # time-first
    m = styles.TimeFirstGroups().double()
    q, k, v = m.query_key_value(x).split([32, 16, 16], -1)
    q, k, v = (t.view(5, 2, -1, 8).permute(1, 2, 0, 3) for t in (q, k, v))
    want = m.dense(_sdpa(q, k, v, True).permute(2, 0, 1, 3).reshape(5, 2, 32))
    assert torch.allclose(m(x), want, atol=1e-10)
    for bug in ("tiled", "repeat", "cat"):
        assert (_same(styles.TimeFirstGroups, m, bug=bug)(x) - want).abs().max() > 1e-3, bug

    x = torch.randn(2, 5, 32, dtype=torch.float64)
    m = styles.RepeatKVGroups().double()
    q = styles.rope(m.q_proj(x).view(2, 5, 4, 8).transpose(1, 2))
    k = styles.rope(m.k_proj(x).view(2, 5, 2, 8).transpose(1, 2))
    v = m.v_proj(x).view(2, 5, 2, 8).transpose(1, 2)
    want = m.o_proj(_sdpa(q, k, v, True).transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(m(x), want, atol=1e-10)
    assert torch.allclose(_same(styles.RepeatKVGroups, m, interleave=True)(x), want, atol=1e-10)
    for bug in ("tiled", "repeat", "stack", "index"):
        assert (_same(styles.RepeatKVGroups, m, bug=bug)(x) - want).abs().max() > 1e-3, bug

    x = torch.randn(2, 5, 48, dtype=torch.float64)
    m = styles.GroupedEinsum().double()
    q = m.wq(x).view(2, 5, 6, 8).transpose(1, 2)
    k, v = (w(x).view(2, 5, 2, 8).transpose(1, 2) for w in (m.wk, m.wv))
    want = m.wo(_sdpa(q, k, v, False).transpose(1, 2).reshape(2, 5, 48))
    assert torch.allclose(m(x), want, atol=1e-10)
    for bug in ("group_order", "group_order_merged", "tiled"):
        assert (_same(styles.GroupedEinsum, m, bug=bug)(x) - want).abs().max() > 1e-3, bug


ROPE = ("--rope", "--causal")
CORRECT = [("TimeFirstGroups", None, ("--causal",)), ("RepeatKVGroups", None, ROPE),
           ("RepeatKVGroups", "interleave=True", ROPE), ("GroupedEinsum", None, ())]


@pytest.mark.parametrize(("name", "init", "options"), CORRECT, ids=case_ids(CORRECT))
def test_correct_groupings_pass(runner, name, init, options):
    assert_passes(*run_case(runner, STYLES, name, init, options))


# (target, bug, options, entry, words the diagnosis holds: the op the code wrote, and the fix in its layout)
PLANTS = [("TimeFirstGroups", "tiled", ("--causal",), "gqa.tiled",
           ("as your .expand (line", "[7, 5, 1, 2, 8] expanded", "([7, 5, 2, 1, 8] expanded)",
            "repeat_interleave(2, dim=2)")),
          ("TimeFirstGroups", "repeat", ("--causal",), "gqa.tiled", ("as .repeat(1, 1, 2, 1) does", "dim=2)")),
          ("TimeFirstGroups", "cat", ("--causal",), "gqa.tiled", ("as your torch.cat (line",)),
          ("RepeatKVGroups", "tiled", ROPE, "gqa.tiled",
           ("as your .expand (line", "the new axis after the heads'", "repeat_interleave(2, dim=1)")),
          ("RepeatKVGroups", "repeat", ROPE, "gqa.tiled", ("as .repeat(1, 2, 1, 1) does",)),
          ("RepeatKVGroups", "stack", ROPE, "gqa.tiled", ("as your torch.stack (line",)),
          ("RepeatKVGroups", "index", ROPE, "gqa.tiled", ("as your index [...] (line",)),
          ("GroupedEinsum", "group_order", (), "gqa.group_order", ("grouped einsum over q",)),
          ("GroupedEinsum", "group_order_merged", (), "gqa.group_order", ("grouped einsum over q",)),
          ("GroupedEinsum", "tiled", (), "gqa.tiled", ("as .repeat(1, 1, 3, 1) does",))]


@pytest.mark.parametrize(("name", "bug", "options", "entry", "words"), PLANTS, ids=case_ids(PLANTS))
def test_the_op_that_lays_the_heads_out_picks_the_entry(runner, name, bug, options, entry, words):
    found = assert_named(*run_case(runner, STYLES, name, f"bug={bug!r}", options), entry)
    for said in words:
        assert said in found["diagnosis"], found["diagnosis"]
    # gqa.tiled never speaks of an einsum the code does not have; gqa.group_order never of a repeat
    assert ("einsum" in found["diagnosis"]) == (entry == "gqa.group_order"), found["diagnosis"]
