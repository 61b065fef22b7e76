"""Heads and projections as books and videos write them, traced in docs/trace.md ("How conventions are read"): a
book's wrapper of single-head causal modules concatenated with no output projection, a 2020 tutorial's
Linear(head_dim, head_dim) every head shares after the split, and a port whose value projection is computed and
thrown away (`bug='values_from_keys'`: the pattern multiplies the keys).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalAttention(nn.Module):
    """One head: its own W_query, W_key, W_value, a triu buffer masked in place."""

    def __init__(self, d_in, d_out, context_length):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys, queries, values = self.W_key(x), self.W_query(x), self.W_value(x)
        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values


class MultiHeadAttentionWrapper(nn.Module):
    """Heads as a ModuleList of one-head modules, concatenated: no output projection (4 heads of 6 on 32 features)."""

    def __init__(self, d_in=32, d_out=6, context_length=16, num_heads=4):
        super().__init__()
        self.heads = nn.ModuleList([CausalAttention(d_in, d_out, context_length) for _ in range(num_heads)])

    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=-1)


class SharedHeadProjection(nn.Module):
    """The input cut in heads first, then one Linear(head_dim, head_dim) per role that every head shares."""

    def __init__(self, embed_size=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, embed_size // heads
        self.values = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.keys = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.queries = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.fc_out = nn.Linear(embed_size, embed_size)

    def forward(self, x):
        n, length, _ = x.shape
        parts = x.reshape(n, length, self.heads, self.head_dim)
        values, keys, queries = self.values(parts), self.keys(parts), self.queries(parts)
        energy = torch.einsum("nqhd,nkhd->nhqk", [queries, keys])
        attention = torch.softmax(energy / math.sqrt(self.head_dim), dim=3)
        out = torch.einsum("nhql,nlhd->nqhd", [attention, values]).reshape(n, length, -1)
        return self.fc_out(out)


class ValueThrownAway(nn.Module):
    """Wq, Wk, Wv, fc; with `bug='values_from_keys'` Wv still runs, and the pattern multiplies the keys."""

    def __init__(self, d=32, h=4, bug=None):
        super().__init__()
        self.d, self.h, self.bug = d, h, bug
        self.Wq, self.Wk, self.Wv, self.fc = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (w(x).reshape(b, n, self.h, -1).permute(0, 2, 1, 3) for w in (self.Wq, self.Wk, self.Wv))
        weights = F.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.d // self.h), -1)
        out = weights @ (k if self.bug == "values_from_keys" else v)
        return self.fc(out.permute(0, 2, 1, 3).reshape(b, n, self.d))
