"""`attnscope trace` on what held-out round 48 found (8/8 correct, 30/32 plants; Gemma 3, Mistral, Llama 4,
ChatGLM2/3, Baichuan-13B, ModernBERT, Granite, DeepSeek-V2). ChatGLM's SelfAttention was refused under --rope
("cannot tell d_head, so RoPE's tables cannot be made; pass --heads"): it keeps its head count and head width as
Megatron-LM does, `num_attention_heads_per_partition` and `hidden_size_per_attention_head`, which are now read
(load.LOCAL_HEAD_NAMES, load.HEAD_DIM_NAMES). The style is checked first against F.scaled_dot_product_attention in
float64, RoPE written out as pairs (2i, 2i + 1) on the first half of each head."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round48_chatglm.py")
styles = user_module(STYLES)
B, T = 2, 9
ROPE = ("--causal", "--rope", "--rope-pairing", "interleaved")


def _pairs(x: torch.Tensor) -> torch.Tensor:
    """RoPE on pairs (2i, 2i + 1) of `x` [.., T, d], angle p · 10000^(-2i/d), in float64."""
    d = x.shape[-1]
    angle = torch.arange(x.shape[-2], dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()), -1).flatten(-2)


def _reference(m, x):
    n, g, d = m.num_attention_heads_per_partition, m.num_multi_query_groups_per_partition, \
        m.hidden_size_per_attention_head
    q, k, v = m.query_key_value(x).split((n * d, g * d, g * d), -1)
    q, k, v = (t.unflatten(-1, (-1, d)).transpose(1, 2) for t in (q, k, v))
    q, k = (torch.cat((_pairs(t[..., :d // 2]), t[..., d // 2:]), -1) for t in (q, k))
    k, v = k.repeat_interleave(n // g, 1), v.repeat_interleave(n // g, 1)
    return m.dense(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


def _run(m, x):  # time-first [T, B, d], the mask True where masked, as ChatGLM's get_masks makes it
    return m(x.transpose(0, 1), ~torch.ones(B, 1, T, T, dtype=torch.bool).tril())[0].transpose(0, 1)


def test_the_style_is_its_formula_and_the_plant_changes_it():
    g = torch.Generator().manual_seed(48)
    m = styles.SelfAttention().double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / math.sqrt(p.shape[-1]))
        x = torch.randn(B, T, 64, generator=g, dtype=torch.float64)
        assert (_run(m, x) - _reference(m, x)).abs().max() < 1e-6  # its softmax and RoPE cache in float32
        planted = styles.SelfAttention(bug="group_tiled").double().eval()
        planted.load_state_dict(m.state_dict())
        assert (_run(planted, x) - _run(m, x)).abs().max() > 1e-3


def test_megatrons_head_names_are_read_without_heads(runner):
    assert_passes(*run_case(runner, STYLES, "SelfAttention", None, ROPE))
    assert_named(*run_case(runner, STYLES, "SelfAttention", "bug='group_tiled'", ROPE), "gqa.tiled")
