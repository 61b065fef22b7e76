"""`attnscope trace` names a grouped-query mistake on the QUERIES' side by experiment (issue #41): the query heads laid
in another order than the checkpoint's before RoPE and the scores (q viewed `[B, n, n_group, n_kv_head, d]` where the
checkpoint means `[.., n_kv_head, n_group, ..]`, then moved and flattened; a litgpt-like per-group fused block moved
group-first; q's heads indexed by an order of the code's own), gqa.query_order, and q's features split (d_head,
n_head) for (n_head, d_head), heads.split_transposed. Before, each diverged at Q_split or Q_rot and trace said "none
of the usual causes fits" (and the fused one passed: its fused layout was read from the code's own q, the heads'
order with it). rope.base's words name where the module's base was read (its config's rope_parameters, not "its
rope_theta or base"). Styles of our own (tests/trace_styles_round30_qorder.py), each correct one checked against
F.scaled_dot_product_attention in float64 with the key/value heads repeated by transformers' repeat_kv and RoPE as
complex products; each plant shown to change the output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from test_trace_round24_ropebase import _rope  # complex products at any base, either pairing, float64
from tracecases import assert_named, assert_passes, case_ids, run_case
from transformers.models.llama.modeling_llama import repeat_kv

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round30_qorder.py")
styles = user_module(STYLES)


def _sdpa(q, k, v, causal):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, g), repeat_kv(v, g), is_causal=causal)


def _heads(t, h):
    return t.view(t.shape[0], t.shape[1], h, -1).transpose(1, 2)


def _planted(cls, m, bug, **init):
    planted = cls(**init, bug=bug)
    planted.load_state_dict(m.state_dict())
    return planted.double()


def test_the_styles_are_grouped_query_sdpa():
    x = torch.randn(2, 5, 48, dtype=torch.float64)
    m = styles.LlamaQOrder().double()
    q, k, v = _heads(m.q_proj(x), 6), _heads(m.k_proj(x), 2), _heads(m.v_proj(x), 2)
    want = m.o_proj(_sdpa(_rope(q, 1e4, False), _rope(k, 1e4, False), v, True).transpose(1, 2).reshape(2, 5, 48))
    assert torch.allclose(m(x), want, atol=1e-10)
    for bug in ("kv_inner", "kv_outer", "dh"):
        assert (_planted(styles.LlamaQOrder, m, bug)(x) - want).abs().max() > 1e-3, bug

    x = torch.randn(2, 5, 32, dtype=torch.float64)
    m = styles.FusedGroups().double()
    rows = m.attn.weight.view(2, 4, 8, 32)  # litgpt's [n_query_groups, q_per_kv + 2, head_size] rows
    bias = m.attn.bias.view(2, 4, 8)
    q, k, v = (_heads(F.linear(x, rows[:, part].reshape(-1, 32), bias[:, part].reshape(-1)), h)
               for part, h in ((slice(0, 2), 4), (2, 2), (3, 2)))
    want = m.proj(_sdpa(_rope(q, 1e4, True), _rope(k, 1e4, True), v, True)
                  .transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(m(x), want, atol=1e-10)
    assert (_planted(styles.FusedGroups, m, "group_order")(x) - want).abs().max() > 1e-3

    x = torch.randn(2, 5, 48, dtype=torch.float64)
    m = styles.EinsumQOrder().double()
    kv = m.to_kv(x)
    q, k, v = _heads(m.to_q(x), 6), _heads(kv[..., :16], 2), _heads(kv[..., 16:], 2)
    want = m.to_out(_sdpa(q, k, v, False).transpose(1, 2).reshape(2, 5, 48))
    assert torch.allclose(m(x), want, atol=1e-10)
    for bug in ("index", "dh"):
        assert (_planted(styles.EinsumQOrder, m, bug)(x) - want).abs().max() > 1e-3, bug

    x = torch.randn(2, 5, 32, dtype=torch.float64)
    m = styles.NanoQ().double()
    q, k, v = (_heads(t, 4) for t in m.c_attn(x).split(32, -1))
    want = m.c_proj(_sdpa(q, k, v, True).transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(m(x), want, atol=1e-10)
    assert (_planted(styles.NanoQ, m, "dh")(x) - want).abs().max() > 1e-3

    config = styles.TextConfig()
    m = styles.ConfigRope(config).double()
    q, k, v = _heads(m.q_proj(x), 4), _heads(m.k_proj(x), 2), _heads(m.v_proj(x), 2)
    want = m.o_proj(_sdpa(_rope(q, 5e5, False), _rope(k, 5e5, False), v, True).transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(m(x), want, atol=1e-10)
    assert (_planted(styles.ConfigRope, m, "forgot_base", config=config)(x) - want).abs().max() > 1e-3


ROPE = ("--rope", "--causal")
FUSED = ("--rope", "--rope-pairing", "interleaved", "--causal")
CONFIG = "config=TextConfig()"
CORRECT = [("LlamaQOrder", None, ROPE), ("FusedGroups", None, FUSED), ("EinsumQOrder", None, ()),
           ("NanoQ", None, ("--causal",)), ("ConfigRope", CONFIG, ROPE)]


@pytest.mark.parametrize(("name", "init", "options"), CORRECT, ids=case_ids(CORRECT))
def test_correct_styles_pass(runner, name, init, options):
    assert_passes(*run_case(runner, STYLES, name, init, options))


# (target, init, options, entry, words the diagnosis holds: the order reproduced, what it means for the groups)
GROUPS = "heads of one key/value group are not next to each other"
PLANTS = [("LlamaQOrder", "bug='kv_inner'", ROPE, "gqa.query_order",
           ("taken in the order 0, 2, 4, 1, 3, 5", GROUPS, "key/value head 0 is read by the checkpoint's query heads "
            "0, 2, 4", "[.., n_group, n_kv_head, ..] (n_group outer)")),
          ("LlamaQOrder", "bug='kv_outer'", ROPE, "gqa.query_order",
           ("taken in the order 0, 3, 1, 4, 2, 5", GROUPS, "[.., n_kv_head, n_group, ..] (n_kv_head outer)")),
          ("LlamaQOrder", "bug='dh'", ROPE, "heads.split_transposed", ("split as (d_head, n_head)",)),
          ("FusedGroups", "bug='group_order'", FUSED, "gqa.query_order",
           ("taken in the order 0, 2, 1, 3", GROUPS, "key/value head 1 is read by the checkpoint's query heads 1, 3")),
          ("EinsumQOrder", "bug='index'", (), "gqa.query_order",
           ("taken in the order 1, 4, 0, 5, 3, 2", "your 0 is its 1", GROUPS)),
          ("EinsumQOrder", "bug='dh'", (), "heads.split_transposed", ("every 6th feature",)),
          ("NanoQ", "bug='dh'", ("--causal",), "heads.split_transposed", ("view(.., 8, 4) then the two swapped",))]
# test_trace_catalog's check that each entry is planted in three styles: entry -> [(target, init, options)]
PLANTED = {entry: [(name, init, options) for name, init, options, e, _ in PLANTS if e == entry]
           for entry in ("gqa.query_order", "heads.split_transposed")}


@pytest.mark.parametrize(("name", "init", "options", "entry", "words"), PLANTS, ids=case_ids(PLANTS))
def test_query_head_order_is_named_by_experiment(runner, name, init, options, entry, words):
    found = assert_named(*run_case(runner, STYLES, name, init, options), entry)
    assert found["reference"] in ("Q_split", "Q_rot", "scores"), found
    for said in words:
        assert said in found["diagnosis"], found["diagnosis"]


def test_rope_base_words_name_the_config(runner):
    found = assert_named(*run_case(runner, STYLES, "ConfigRope", f"{CONFIG}, bug='forgot_base'", ROPE),
                         "rope.base")
    said = found["diagnosis"]
    assert "where your module says 500000 (its config's rope_parameters: " \
           "self.config.rope_parameters['rope_theta'])" in said, said
    assert "its rope_theta or base" not in said, said
