"""lit-gpt's CausalSelfAttention as it stood in 2023 (lit_gpt/model.py): one `attn` Linear laid per query group
[n_query_groups, q_per_kv + 2, head_size], k and v expanded to the query heads BEFORE RoPE, RoPE on the first
`rope_n_elem` coordinates (half-split, its `build_rope_cache` / `apply_rope`), SDPA with is_causal, `proj`.
Correct, and two planted mistakes."""

import math

import torch
import torch.nn.functional as F
from torch import nn


def build_rope_cache(seq_len, n_elem, base=10000):
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2).float() / n_elem))
    idx_theta = torch.outer(torch.arange(seq_len).float(), theta).repeat(1, 2)
    return torch.cos(idx_theta), torch.sin(idx_theta)


def apply_rope(x, cos, sin):
    head_size = x.size(-1)
    x1, x2 = x[..., : head_size // 2], x[..., head_size // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return ((x * cos) + (rotated * sin)).type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd=64, n_head=4, n_query_groups=2, rope_n_elem=8):
        super().__init__()
        self.n_head, self.n_query_groups, self.head_size = n_head, n_query_groups, n_embd // n_head
        self.attn = nn.Linear(n_embd, (n_head + 2 * n_query_groups) * self.head_size, bias=True)
        self.proj = nn.Linear(n_embd, n_embd, bias=True)
        self.rope_n_elem = rope_n_elem
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():  # trained-looking: no zero bias
            for p in self.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))

    def scale(self):
        return 1.0 / math.sqrt(self.head_size)

    def forward(self, x):
        B, T, C = x.size()
        cos, sin = build_rope_cache(T, self.rope_n_elem)
        q_per_kv = self.n_head // self.n_query_groups
        qkv = self.attn(x).view(B, T, self.n_query_groups, q_per_kv + 2, self.head_size)
        qkv = qkv.permute(0, 2, 3, 1, 4)  # (B, n_query_groups, total_qkv, T, hs)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        k = k.expand(B, self.n_query_groups, q_per_kv, T, self.head_size)
        v = v.expand(B, self.n_query_groups, q_per_kv, T, self.head_size)
        q = q.reshape(B, -1, T, self.head_size)
        k = k.reshape(B, -1, T, self.head_size)
        v = v.reshape(B, -1, T, self.head_size)
        q_roped = apply_rope(q[..., : self.rope_n_elem], cos, sin)
        k_roped = apply_rope(k[..., : self.rope_n_elem], cos, sin)
        q = torch.cat((q_roped, q[..., self.rope_n_elem:]), dim=-1)
        k = torch.cat((k_roped, k[..., self.rope_n_elem:]), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, scale=self.scale(), is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class NoScale(CausalSelfAttention):
    def scale(self):
        return 1.0  # scale.none


class ValuesRotated(CausalSelfAttention):
    """RoPE applied to the values too, after the head repeat."""

    def forward(self, x):
        B, T, C = x.size()
        cos, sin = build_rope_cache(T, self.rope_n_elem)
        q_per_kv = self.n_head // self.n_query_groups
        qkv = self.attn(x).view(B, T, self.n_query_groups, q_per_kv + 2, self.head_size)
        qkv = qkv.permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        k = k.expand(B, self.n_query_groups, q_per_kv, T, self.head_size)
        v = v.expand(B, self.n_query_groups, q_per_kv, T, self.head_size)
        q = q.reshape(B, -1, T, self.head_size)
        k = k.reshape(B, -1, T, self.head_size)
        v = v.reshape(B, -1, T, self.head_size)
        q = torch.cat((apply_rope(q[..., : self.rope_n_elem], cos, sin), q[..., self.rope_n_elem:]), dim=-1)
        k = torch.cat((apply_rope(k[..., : self.rope_n_elem], cos, sin), k[..., self.rope_n_elem:]), dim=-1)
        v = torch.cat((apply_rope(v[..., : self.rope_n_elem], cos, sin), v[..., self.rope_n_elem:]), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, scale=self.scale(), is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
