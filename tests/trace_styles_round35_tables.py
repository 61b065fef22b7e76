"""Styles for tests/test_trace_round35_tables.py (held-out round 35): Qwen-1's attention, RoPE's tables handed as
`rotary_pos_emb_list`, a list of one pair (cos, sin) each [1, n, 1, d_head], the rotation skipped where it is None;
transformers' Pixtral vision attention, its (cos, sin) one pair [n_patches, d_head] for every image, unsqueezed at 0.
`bug=` plants a mistake."""

from __future__ import annotations

import math

import torch
from torch import nn


def _moved(module: nn.Module, seed: int) -> None:
    """Every weight off its initial value (trained-looking: no zero bias, no unit gain)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    """Qwen-1's: t [b, s, h, d], freqs (cos, sin) each [1, s, 1, rot_dim]."""
    cos, sin = freqs
    rot_dim = cos.shape[-1]
    t_, t_pass = t[..., :rot_dim].float(), t[..., rot_dim:].float()
    t_ = (t_ * cos) + (_rotate_half(t_) * sin)
    return torch.cat((t_, t_pass), dim=-1).type_as(t)


class QWenAttention(nn.Module):
    """Qwen-1: a fused c_attn split in three, heads split [b, s, h, d], RoPE from the list it is handed, a causal
    tril of its own, `c_proj`. 'scale_twice' divides its scores by √d_head again; 'rope_q_only' turns the queries
    alone."""

    def __init__(self, hidden_size=64, num_attention_heads=4, bug=None):
        super().__init__()
        self.bug, self.num_heads = bug, num_attention_heads
        self.head_dim = hidden_size // num_attention_heads
        self.c_attn = nn.Linear(hidden_size, 3 * hidden_size)
        self.c_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        _moved(self, 51)

    def forward(self, hidden_states, rotary_pos_emb_list=None, attention_mask=None):
        b, s, _ = hidden_states.shape
        query, key, value = (t.view(b, s, self.num_heads, self.head_dim)
                             for t in self.c_attn(hidden_states).split(hidden_states.shape[-1], dim=2))
        if rotary_pos_emb_list is not None:
            pos_emb = [i[:, -s:, :, :] for i in rotary_pos_emb_list[0]]
            query = apply_rotary_pos_emb(query, pos_emb)
            if self.bug != "rope_q_only":
                key = apply_rotary_pos_emb(key, pos_emb)
        query, key, value = (t.permute(0, 2, 1, 3) for t in (query, key, value))
        weights = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.head_dim)
        if self.bug == "scale_twice":
            weights = weights / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
        weights = torch.where(causal, weights, torch.finfo(weights.dtype).min)
        if attention_mask is not None:
            weights = weights + attention_mask
        out = torch.matmul(weights.softmax(dim=-1), value).permute(0, 2, 1, 3).reshape(b, s, -1)
        return self.c_proj(out)


def apply_shared(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0): cos, sin [n, d] for every image."""
    cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class PixtralAttention(nn.Module):
    """Pixtral's vision attention: q, k, v, o projections without bias, (cos, sin) [n_patches, d_head] handed in,
    an additive mask. 'scale_d_model' divides by √d_model."""

    def __init__(self, hidden_size=64, num_attention_heads=4, bug=None):
        super().__init__()
        self.bug, self.num_heads = bug, num_attention_heads
        self.head_dim = hidden_size // num_attention_heads
        self.scale = (hidden_size if bug == "scale_d_model" else self.head_dim) ** -0.5
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        _moved(self, 52)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        batch_size, patches, _ = hidden_states.size()
        q, k, v = (p(hidden_states).view(batch_size, patches, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = position_embeddings
        q, k = apply_shared(q, k, cos, sin)
        weights = torch.matmul(q, k.transpose(2, 3)) * self.scale
        if attention_mask is not None:
            weights = weights + attention_mask
        out = torch.matmul(weights.softmax(dim=-1), v).transpose(1, 2).reshape(batch_size, patches, -1)
        return self.o_proj(out)
