"""`attnscope trace` on what held-out round 50 found (6/8 correct, 22/32 plants at first; Phi-3, OLMo 1, GLM-4,
GPT-OSS, Qwen3-Next, CLIP text, SmolLM3, ALBERT; 8/8 and 32/32 after):

- GPT-OSS's reference joins its sinks `[n_kv_head, q_mult, n, 1]`, a KV head's group of query heads on an axis of
  its own: sinkcols.sink_column reads the heads on the fewest axes before the queries' that hold them.
- Qwen3-Next's gated q_proj: a chance tie among its float32 outputs made the rows the queries read unreadable
  (widerows now tolerates a few, as fused.solve_rows does); without a norm before its partial RoPE the queries'
  rows are read from both slices of the projection (rotated and passed) together; its keys' own norm, gain 1 + 0,
  called on the values is qknorm.on_values, never read as a weightless norm of the values.
- SmolLM3's NoPE layer rotated by mistake, under GQA: its frequencies are read from the keys as repeat_kv hands them
  to the scores, and said as the base they are (2000000), with the --rope-base to describe them.
- CLIP's softmax over the queries of scores with the heads in the batch (`[B·H, T, T]`): its own masked numbers
  (two finfo.min masks added) read in the scores' layout.

Each style is checked first against F.scaled_dot_product_attention in float64, with transformers' own
apply_rotary_pos_emb for RoPE."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope
from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb as qwen3next_rope

HERE = Path(__file__).resolve().parent
STYLES = {name: str(HERE / f"trace_styles_round50_{name}.py") for name in ("gptoss", "qwen3next", "smollm3", "clip")}
styles = {name: user_module(path) for name, path in STYLES.items()}
B, T = 2, 7
PAD = np.ones((B, T), dtype=bool)
PAD[1, -2:] = False  # the second sequence's last two tokens are padding


def _trained(m, plus_one=False):
    """Every weight off its initial value (norm weights too), in float64."""
    g = torch.Generator().manual_seed(50)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype) + (0.0 if plus_one else 1.0))
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / math.sqrt(p.shape[-1] if p.dim() > 1
                                                                                      else 16))
    return m.double().eval()


def _tables(n, d, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = torch.arange(n, dtype=torch.float64)[:, None] * inv
    emb = torch.cat((f, f), -1)
    return emb.cos()[None], emb.sin()[None]


def _heads(x, n):
    return x.unflatten(-1, (n, -1)).transpose(-3, -2)


def _merge(x):
    return x.transpose(-3, -2).flatten(-2)


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(51), dtype=torch.float64)


def _differs(a, b):
    return bool((a - b).nan_to_num(nan=1.0).abs().max() > 1e-3)


def test_the_styles_are_their_formulas_and_the_plants_change_them():
    with torch.no_grad():
        # GPT-OSS: the sink one more key of value 0, every other layer windowed (layer 0: a window of 4)
        make = lambda bug=None: _trained(styles["gptoss"].AttentionBlock(bug=bug))  # noqa: E731
        m, n = make(), 9
        x = _x(n, 48)
        q, k, v = F.linear(x, m.qkv.weight, m.qkv.bias).split([64, 16, 16], -1)
        q, k, v = _heads(q, 8)[None], _heads(k, 2)[None], _heads(v, 2)[None]
        q, k = llama_rope(q, k, *_tables(n, 8, 150000.0))
        k, v = (torch.cat((t.repeat_interleave(4, 1), torch.zeros(1, 8, 1, 8, dtype=t.dtype)), 2) for t in (k, v))
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        bias = torch.where((j <= i) & (i - j < 4), 0.0, float("-inf")).expand(1, 8, n, n)
        bias = torch.cat((bias, m.sinks.view(1, 8, 1, 1).expand(1, 8, n, 1)), -1)
        reference = F.linear(_merge(F.scaled_dot_product_attention(q, k, v, attn_mask=bias))[0], m.out.weight,
                             m.out.bias)
        got = m(x)
        assert (got - reference).abs().max() < 1e-6
        for bug in ("window_wide", "q_group_order"):
            planted = make(bug)
            assert _differs(planted(x), got)
        # Qwen3-Next: q beside its gate, (1 + w) RMSNorm per head, RoPE on a quarter of each head
        make = lambda bug=None: _trained(styles["qwen3next"].Qwen3NextAttention(bug=bug), plus_one=True)  # noqa: E731
        m = make()
        x = _x(B, T, 64)
        mask = torch.zeros(T, T, dtype=torch.float64).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(),
                                                                  torch.finfo(torch.float64).min).expand(B, 1, T, T)
        got = m(x, attention_mask=mask)[0]
        qg = (x @ m.q_proj.weight.T).view(B, T, 4, 32)
        q, gate = qg[..., :16], qg[..., 16:].reshape(B, T, 64)
        q = F.rms_norm(q, (16,), 1 + m.q_norm.weight, 1e-6).transpose(1, 2)
        k = F.rms_norm(_heads(x @ m.k_proj.weight.T, 2).transpose(1, 2), (16,), 1 + m.k_norm.weight, 1e-6)
        q, k = qwen3next_rope(q, k.transpose(1, 2), *_tables(T, 4))
        v = _heads(x @ m.v_proj.weight.T, 2)
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
        assert (got - (_merge(out) * torch.sigmoid(gate)) @ m.o_proj.weight.T).abs().max() < 1e-6
        for bug in ("no_q_norm", "v_normed"):
            assert _differs(make(bug)(x, attention_mask=mask)[0], got)
        # SmolLM3's NoPE layer (layer 3): no rotation at all
        make = lambda bug=None: _trained(styles["smollm3"].SmolLM3Attention(bug=bug))  # noqa: E731
        m = make()
        mask = mask[..., :T, :T]
        got = m(x, attention_mask=mask)[0]
        q, k, v = _heads(F.linear(x, m.q_proj.weight), 8), _heads(F.linear(x, m.k_proj.weight), 2), \
            _heads(F.linear(x, m.v_proj.weight), 2)
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
        assert (got - F.linear(_merge(out), m.o_proj.weight)).abs().max() < 1e-6
        assert _differs(make("nope_rotated")(x, attention_mask=mask)[0], got)
        # CLIP text: causal and padding, heads in the batch
        make = lambda bug=None: _trained(styles["clip"].CLIPTextSelfAttention(bug=bug))  # noqa: E731
        m = make()
        x, pad = _x(B, T, 48), torch.from_numpy(PAD)
        got = m(x, attention_mask=pad.long())[0]
        q, k, v = (_heads(F.linear(x, p.weight, p.bias), 6) for p in (m.q_proj, m.k_proj, m.v_proj))
        allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & pad[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        assert (got - F.linear(_merge(out), m.out_proj.weight, m.out_proj.bias)).abs().max() < 1e-6
        assert _differs(make("softmax_dim1")(x, attention_mask=pad.long())[0], got)


GPTOSS = ("--batch", "0", "--rope", "--rope-base", "150000", "--rope-pairing", "half-split", "--window", "4")


def test_sinks_joined_with_the_heads_on_two_axes(runner):
    code, out = run_case(runner, STYLES["gptoss"], "AttentionBlock", None, GPTOSS)
    assert_passes(code, out)
    assert any("attention sinks" in note for note in out["notes"]), out["notes"]
    assert_named(*run_case(runner, STYLES["gptoss"], "AttentionBlock", "bug='window_wide'", GPTOSS),
                 "mask.off_by_one")
    assert_named(*run_case(runner, STYLES["gptoss"], "AttentionBlock", "bug='q_group_order'", GPTOSS),
                 "gqa.query_order")


QWEN = ("--causal", "--rope", "--qk-norm", "head")


@pytest.mark.parametrize(("init", "entry"), [(None, None), ("bug='no_q_norm'", "qknorm.missing"),
                                             ("bug='norm_after_rope'", "qknorm.place"),
                                             ("bug='v_normed'", "qknorm.on_values")])
def test_gated_queries_partial_rope_and_norms(runner, init, entry):
    code, out = run_case(runner, STYLES["qwen3next"], "Qwen3NextAttention", init, QWEN)
    if entry is None:
        assert_passes(code, out)  # at seed 0 two of q_proj's outputs tie: its rows still read
        assert any("q_proj writes 128 features" in note for note in out["notes"]), out["notes"]
    else:
        assert_named(code, out, entry)


def test_a_rope_untold_under_gqa_is_said_with_its_base(runner):
    found = assert_named(*run_case(runner, STYLES["smollm3"], "SmolLM3Attention", "bug='nope_rotated'",
                                   ("--causal",)), "rope.untold")
    assert "base 2000000" in found["diagnosis"] and "--rope-base 2000000" in found["diagnosis"], found


def test_softmax_over_queries_with_heads_in_the_batch(runner, tmp_path):
    np.save(tmp_path / "pad.npy", PAD)
    options = ("--causal", "--mask", str(tmp_path / "pad.npy"), "--batch", "2", "--nq", "7")
    assert_passes(*run_case(runner, STYLES["clip"], "CLIPTextSelfAttention", None, options))
    assert_named(*run_case(runner, STYLES["clip"], "CLIPTextSelfAttention", "bug='softmax_dim1'", options),
                 "softmax.axis")
