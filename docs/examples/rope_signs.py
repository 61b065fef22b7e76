"""RoPE and softmax conventions of nanochat and GPT-OSS (docs/trace.md, "How conventions are read"):

- `NanochatAttention`: nanochat's `apply_rotary_emb`, `y1 = x1 * cos + x2 * sin; y2 = x1 * (-sin) + x2 * cos`, each
  pair turned by −θ, with its own tables as buffers, a weight-free `F.rms_norm` on q and k after RoPE and GQA by
  SDPA's `enable_gqa`. bug="tiled" repeats the key/value heads with `.repeat` (tiled, where query head h reads
  key/value head h // 2).
"""

import torch
import torch.nn.functional as F
from torch import nn


def apply_rotary_emb(x, cos, sin):
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    y1 = x1 * cos + x2 * sin
    y2 = x1 * (-sin) + x2 * cos
    return torch.cat([y1, y2], 3)


def rotary_tables(seq_len, head_dim, base=10000):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]  # [1, T, 1, head_dim / 2]


class NanochatAttention(nn.Module):
    def __init__(self, n_embd=32, n_head=4, n_kv_head=2, bug=None):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim, self.bug = n_head, n_kv_head, n_embd // n_head, bug
        self.c_q = nn.Linear(n_embd, n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        cos, sin = rotary_tables(64, self.head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        B, T, C = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = self.cos[:, :T], self.sin[:, :T]
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.bug == "tiled":
            k, v = k.repeat(1, self.n_head // self.n_kv_head, 1, 1), v.repeat(1, self.n_head // self.n_kv_head, 1, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.bug != "tiled")
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))
