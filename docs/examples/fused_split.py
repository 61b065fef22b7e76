"""A fused projection whose heads are split from its output (docs/trace.md, the catalog's heads.split_without_permute):

- `ElmAttention`: Apple OpenELM's: one qkv_proj for 4 query and 2 key/value heads, its output reshaped
  [b, s, 4 + 2 + 2, d], transposed and split by head counts, q/k RMSNorm, RoPE, SDPA. bug="straight" reshapes the
  output straight to [b, 4 + 2 + 2, s, d] (the transpose left out).
"""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class ElmAttention(nn.Module):
    def __init__(self, model_dim=64, head_dim=16, q_heads=4, kv_heads=2, bug=None):
        super().__init__()
        self.head_dim, self.q_heads, self.kv_heads, self.bug = head_dim, q_heads, kv_heads, bug
        self.qkv_proj = nn.Linear(model_dim, (q_heads + 2 * kv_heads) * head_dim, bias=False)
        self.q_norm, self.k_norm = RMSNorm(head_dim), RMSNorm(head_dim)
        self.out_proj = nn.Linear(q_heads * head_dim, model_dim, bias=False)

    def forward(self, hidden_states):
        b, s, _ = hidden_states.shape
        heads = self.q_heads + 2 * self.kv_heads
        qkv = self.qkv_proj(hidden_states)
        if self.bug == "straight":
            qkv = qkv.reshape(b, heads, s, self.head_dim)
        else:
            qkv = qkv.reshape(b, s, heads, self.head_dim).transpose(1, 2)
        queries, keys, values = qkv.split([self.q_heads, self.kv_heads, self.kv_heads], dim=1)
        queries, keys = self.q_norm(queries), self.k_norm(keys)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        emb = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
        cos, sin = torch.cat((emb, emb), -1).cos(), torch.cat((emb, emb), -1).sin()
        queries, keys = queries * cos + rotate_half(queries) * sin, keys * cos + rotate_half(keys) * sin
        group = self.q_heads // self.kv_heads
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, self.q_heads * self.head_dim))
