"""Attention cores that take q, k and v time-first with their heads split, [n, n_batch, n_head, d] (Megatron-LM's
CoreAttention [sq, b, np, hn]; tests/test_trace_round10_timeheads.py). Each has bugs of its own kind."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class TimeFirstCore(nn.Module):
    """Megatron-LM's CoreAttention as its repository writes it: [sq, b, np, hn] folded to [b·np, sq, hn] by
    transposes, torch.baddbmm with alpha = 1/√hn, masked_fill_(mask, -10000.0) (True = masked), bmm with the values,
    permute(2, 0, 1, 3) and view(sq, b, hp), hp = np · kv_channels."""

    def __init__(self, num_attention_heads: int = 4, kv_channels: int = 8, bug: str | None = None):
        super().__init__()
        self.hidden_size_per_partition = num_attention_heads * kv_channels
        self.norm_factor = math.sqrt(kv_channels)
        self.bug = bug

    def forward(self, query_layer, key_layer, value_layer, attention_mask):
        sq, b, np_, hn = query_layer.shape
        sk = key_layer.size(0)
        q = query_layer.reshape(sq, b * np_, -1)
        k = key_layer.reshape(sk, b * np_, -1)
        buffer = torch.empty(b * np_, sq, sk, dtype=q.dtype)
        scores = torch.baddbmm(buffer, q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2), beta=0.0,
                               alpha=1.0 / self.norm_factor).view(b, np_, sq, sk)
        scores.masked_fill_(attention_mask, -10000.0)
        probs = torch.nn.Softmax(dim=-2 if self.bug == "softmax_dim" else -1)(scores)
        v = value_layer.reshape(sk, b * np_, -1)
        context = torch.bmm(probs.view(b * np_, sq, sk), v.transpose(0, 1)).view(b, np_, sq, -1)
        if self.bug == "no_permute":
            return context.reshape(sq, b, self.hidden_size_per_partition)
        return context.permute(2, 0, 1, 3).contiguous().view(sq, b, self.hidden_size_per_partition)


def time_heads_attention(query, key, value):
    """A function on [s, b, h, d] (a JAX/Flax-like einsum core written time-first): scores 'sbhd,tbhd->bhst',
    softmax over the keys, back to [s, b, h, d]."""
    scores = torch.einsum("sbhd,tbhd->bhst", query, key) / math.sqrt(query.shape[-1])
    return torch.einsum("bhst,tbhd->sbhd", scores.softmax(dim=-1), value)


def time_heads_attention_over_queries(query, key, value):
    scores = torch.einsum("sbhd,tbhd->bhst", query, key) / math.sqrt(query.shape[-1])
    return torch.einsum("bhst,tbhd->sbhd", scores.softmax(dim=-2), value)


def time_heads_attention_by_d(query, key, value):
    scores = torch.einsum("sbhd,tbhd->bhst", query, key) / query.shape[-1]
    return torch.einsum("bhst,tbhd->sbhd", scores.softmax(dim=-1), value)


class TimeFirstSDPA(nn.Module):
    """A weightless core in front of F.scaled_dot_product_attention that takes Megatron's layout: permute(1, 2, 0, 3)
    to [b, h, s, d], SDPA with a boolean mask (True = may attend), back to [s, b, h·d] by permute and reshape."""

    def __init__(self, bug: str | None = None):
        super().__init__()
        self.bug = bug

    def forward(self, q, k, v, attn_mask):
        s, b, h, d = q.shape
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), attn_mask=attn_mask)
        if self.bug == "no_permute":
            return out.reshape(s, b, -1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def raises_before_its_mask(query, key, value, mask):
    """Code that raises before it reads its mask (a width of its own that no input has)."""
    scores = query.reshape(*query.shape[:-1], 3, -1) @ key.transpose(-2, -1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ value


class QueriesWidthCore(nn.Module):
    """A weightless time-first core that merges its heads back with the queries' width, `reshape(s, b, h * d)` with
    d read off the queries (so d_V must equal d_K); `masked_fill(mask, -10000.0)`, True = masked out."""

    def forward(self, query, key, value, attention_mask):
        s, b, h, d = query.shape
        scores = torch.matmul(query.permute(1, 2, 0, 3), key.permute(1, 2, 3, 0)) / math.sqrt(d)
        probs = torch.softmax(scores.masked_fill(attention_mask, -10000.0), dim=-1)
        context = torch.matmul(probs, value.permute(1, 2, 0, 3))
        return context.permute(2, 0, 1, 3).reshape(s, b, h * d)
