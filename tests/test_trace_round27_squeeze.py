"""`attnscope trace` on forwards that take a flag with no default (round 27's HF SqueezeBertSelfAttention,
`forward(hidden_states, attention_mask, output_attentions)` over [B, C, W]): the flag was fed a tensor, read as a
second input (cross-attention), and `if output_attentions:` raised, so the column form that docs/trace.md promises
never ran either. Now a required parameter the code reads only as a truth value, or hands on unread under a flag's
name, is given False (usertrace/flags.py, read from the forward's AST); a required mask the code reads with no test
for None is given one that masks nothing where none is asked for; the column form hands a key-padding mask as the
code's scores are laid out; and a merge of the heads without its permute is named in the column form too. Styles of
our own (tests/trace_styles_round27_squeeze.py), each checked against F.scaled_dot_product_attention in float64."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round27_squeeze.py")
styles = user_module(STYLES)


@pytest.fixture()
def files(tmp_path):
    """A key-padding file [n_batch, n_K] = [2, 7] (True = a real token)."""
    pad = np.ones((2, 7), dtype=bool)
    pad[0, 5:] = False
    np.save(tmp_path / "pad.npy", pad)
    return {"PAD": str(tmp_path / "pad.npy")}


def _conv(x, layer):
    return torch.einsum("oc,bcw->bow", layer.weight[..., 0], x) + layer.bias[:, None]


def _heads(t, n_head):
    """[B, C, W] -> [B, H, W, d]."""
    B, C, W = t.shape
    return t.reshape(B, n_head, C // n_head, W).transpose(-2, -1)


def test_the_styles_are_attention():
    torch.manual_seed(0)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 5:] = False
    allowed = keep[:, None, None, :]
    bias = torch.zeros(2, 1, 1, 7, dtype=torch.float64).masked_fill(~allowed, -math.inf)
    x = torch.randn(2, 32, 7, dtype=torch.float64)
    m = styles.FusedSqueeze().double()
    q, k, v = (_heads(t, 4) for t in _conv(x, m.qkv).chunk(3, dim=1))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(-2, -1).reshape(2, 32, 7)
    torch.testing.assert_close(m(x, bias, False)[0], _conv(want, m.proj))
    m = styles.ConvKeep().double()
    q, k, v = (_heads(_conv(x, layer), 4) for layer in (m.q, m.k, m.v))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(-2, -1).reshape(2, 32, 7)
    torch.testing.assert_close(m(x, keep[:, None, None, :].double(), False)["context"], want, atol=1e-6, rtol=1e-6)
    rows = x.transpose(1, 2)
    m = styles.FlagRows().double()
    q, k, v = (p(rows).view(2, 7, 4, 8).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
    want = m.out_proj(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).reshape(2, 7, 32))
    out, present, weights = m(rows, bias, False, False)
    torch.testing.assert_close(out, want)
    assert present is None and weights is None
    m = styles.CausalRows().double()
    q, k, v = m.c_attn(rows).view(2, 7, 3, 4, 8).permute(2, 0, 3, 1, 4)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    want = m.c_proj(F.scaled_dot_product_attention(q, k, v, attn_mask=causal).transpose(1, 2).reshape(2, 7, 32))
    torch.testing.assert_close(m(rows, None, True), want)


CORRECT = [("FusedSqueeze", None, ()), ("FusedSqueeze", None, ("--layout", "col")),
           ("FlagRows", None, ()), ("FlagRows", None, ("--mask", "PAD", "--batch", "2")),
           ("ConvKeep", None, ()), ("ConvKeep", None, ("--mask", "PAD", "--batch", "2")),
           ("CausalRows", None, ("--causal",))]
PLANTS = [("FusedSqueeze", "bug='no_scale'", (), "scale.none"),
          ("FusedSqueeze", "bug='softmax_queries'", ("--layout", "col"), "softmax.axis"),
          ("FlagRows", "bug='softmax_queries'", (), "softmax.axis"),
          ("FlagRows", "bug='merge_no_transpose'", ("--mask", "PAD", "--batch", "2"), "heads.merge_without_transpose"),
          ("ConvKeep", "bug='merge_no_permute'", (), "heads.merge_without_transpose"),
          ("ConvKeep", "bug='value_from_key'", ("--mask", "PAD", "--batch", "2"), "kv.values_from_keys")]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    x = torch.randn(2, 32, 7)
    for name, init, _, _ in PLANTS:
        kwargs = eval(f"dict({init})")  # noqa: S307 - the rows' own literals
        good, bad = styles.__dict__[name](), styles.__dict__[name](**kwargs)
        if name == "FlagRows":
            outs = [m(x.transpose(1, 2), torch.zeros(1, 7, 7), False, False)[0] for m in (good, bad)]
        else:
            outs = [m(x, torch.ones(1, 7, 7), False) for m in (good, bad)]
            outs = [o["context"] if isinstance(o, dict) else o[0] for o in outs]
        assert (outs[0] - outs[1]).abs().max() > 1e-3, (name, init)


test_correct_styles_pass = passing_test(STYLES, CORRECT, files="files")
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS, files="files")


def test_a_flag_without_a_default_is_the_causal_switch_under_causal(runner):
    code, out = run_case(runner, STYLES, "CausalRows", None, ("--causal",))
    notes = [" ".join(n.split()) for n in out["notes"]]
    assert code == 0 and any(n.startswith("is_causal = True: with it your code masks by itself") for n in notes), notes
    code, out = run_case(runner, STYLES, "CausalRows")
    notes = [" ".join(n.split()) for n in out["notes"]]
    assert code == 0 and any(n.startswith("is_causal = False: your code reads it as a flag") for n in notes), notes


def test_flags_are_read_from_how_the_code_uses_them():
    from attnscope.usertrace import flags

    def forward(x, context, output_attentions, use_cache, need, scale_by):
        k = context @ x
        if output_attentions and k.dim() > 2:
            k = k * 2
        keep = _on(k, use_cache)  # handed on unread, a flag by its name
        if not need:  # a truth test alone
            k = k + 1
        return k * scale_by, keep  # scale_by computes: a tensor

    names = ["x", "context", "output_attentions", "use_cache", "need", "scale_by"]
    assert flags.read(forward, names) == ["output_attentions", "use_cache", "need"]

    def handed_on(hidden, memory, is_first):
        return _on(hidden, memory), is_first is True  # memory handed on, no flag's name: not a flag

    assert flags.read(handed_on, ["hidden", "memory", "is_first"]) == ["is_first"]


def test_a_mask_is_needed_only_where_the_code_reads_it_without_a_test():
    from attnscope.usertrace import flags

    def added(x, attention_mask):
        return x + attention_mask

    def tested(x, attention_mask):
        return x if attention_mask is None else x + attention_mask

    def handed(x, attention_mask):
        return _on(x, attention_mask)

    def optional(x, attention_mask=None):
        return x + attention_mask

    assert flags.mask_needed(added, "attention_mask")
    assert not any(flags.mask_needed(f, "attention_mask") for f in (tested, handed, optional))


def _on(a, b):
    return a, b
