"""A LLaMA-style attention layer, written as the from-scratch ports write it: q/k/v/o projections without bias,
grouped-query attention (n_kv_heads key/value heads shared by n_heads query heads), rotary position embeddings
in the half-split form of transformers' LLaMA (`rotate_half`), a KV cache for decode steps and Meta's additive
mask (`scores + mask`). docs/trace.md traces it, and the two classes after it, each with one classic mistake:

    attnscope trace docs/examples/llama.py:Attention --init "dim=64, n_heads=4, n_kv_heads=2" --rope --causal
    attnscope trace docs/examples/llama.py:Attention --init "dim=64, n_heads=4, n_kv_heads=2" --rope --cache 4
    attnscope trace docs/examples/llama.py:InterleavedAttention --init "dim=64, n_heads=4, n_kv_heads=2" --rope --rope-pairing half-split --causal
    attnscope trace docs/examples/llama.py:NoOffsetAttention --init "dim=64, n_heads=4, n_kv_heads=2" --rope --cache 4
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x):
    """[x1, x2] -> [-x2, x1]: coordinate i is paired with i + head_dim / 2."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep):
    """[batch, n_kv_heads, seq, head_dim] -> [batch, n_kv_heads * n_rep, seq, head_dim]"""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, rope_theta=10000.0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.n_rep = n_heads // n_kv_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope_tables(self, start, n):
        positions = torch.arange(start, start + n).float()
        freqs = torch.outer(positions, self.inv_freq)  # [n, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [n, head_dim]
        return emb.cos(), emb.sin()

    def rotate(self, x, cos, sin):
        return x * cos + rotate_half(x) * sin

    def forward(self, x, mask=None, kv_cache=None):
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)  # [b, n_heads, n, head_dim]
        k = self.wk(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [b, n_kv_heads, n, head_dim]
        v = self.wv(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        start = 0 if kv_cache is None else kv_cache[0].shape[2]
        cos, sin = self.rope_tables(start, n)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        if kv_cache is not None:  # the cached keys are already rotated
            k = torch.cat([kv_cache[0], k], dim=2)
            v = torch.cat([kv_cache[1], v], dim=2)
        keys, values = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        scores = q @ keys.transpose(2, 3) / math.sqrt(self.head_dim)  # [b, n_heads, n, n_cache + n]
        if mask is not None:
            scores = scores + mask  # Meta's convention: 0 where a query may attend, -inf elsewhere
        attn = F.softmax(scores.float(), dim=-1).type_as(q)
        out = (attn @ values).transpose(1, 2).reshape(b, n, -1)  # [b, n, n_heads * head_dim]
        return self.wo(out)


class InterleavedAttention(Attention):
    """The same layer rotating GPT-J's way: coordinates paired (0, 1), (2, 3), ..."""

    def rotate(self, x, cos, sin):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        c, s = cos[..., : x.shape[-1] // 2], sin[..., : x.shape[-1] // 2]  # pair i turns at frequency i
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)


class NoOffsetAttention(Attention):
    """The same layer forgetting, in a decode step, that the new tokens come after the cached ones."""

    def rope_tables(self, start, n):
        return super().rope_tables(0, n)
