"""The per-head steps between the projections and the scores in another order, for docs/trace.md ("How
conventions are read"): q and k rotated first, then LayerNormed per head with a weight and a bias (Qwen3 and OLMo
norm before RoPE); grouped key/value heads; an output projection whose name says no role.

`bug=` plants a mistake: "split_qk" (q and k viewed straight into heads, v split right), "kv_swapped" (the key
and value projections' outputs swapped before RoPE and the norm).
"""

import torch
from torch import nn


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotatedNormAttention(nn.Module):
    def __init__(self, dim=32, n_head=4, n_kv_head=2, bug=None):
        super().__init__()
        self.h, self.kv, self.d, self.bug = n_head, n_kv_head, dim // n_head, bug
        self.q_proj = nn.Linear(dim, n_head * self.d)
        self.k_proj = nn.Linear(dim, n_kv_head * self.d)
        self.v_proj = nn.Linear(dim, n_kv_head * self.d)
        self.proj = nn.Linear(n_head * self.d, dim)
        self.q_norm, self.k_norm = nn.LayerNorm(self.d), nn.LayerNorm(self.d)
        with torch.no_grad():  # trained: gains and biases off 1 and 0
            for norm in (self.q_norm, self.k_norm):
                norm.weight.copy_(torch.linspace(0.5, 1.5, self.d))
                norm.bias.copy_(torch.linspace(-0.2, 0.2, self.d))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.bug == "kv_swapped":
            k, v = v, k
        if self.bug == "split_qk":  # viewed straight, without the transpose
            q, k = q.view(b, self.h, n, self.d), k.view(b, self.kv, n, self.d)
        else:
            q, k = q.view(b, n, self.h, self.d).transpose(1, 2), k.view(b, n, self.kv, self.d).transpose(1, 2)
        v = v.view(b, n, self.kv, self.d).transpose(1, 2)  # [b, n_kv_head, n, d]
        inv = 10000.0 ** (-torch.arange(0, self.d, 2, dtype=x.dtype) / self.d)
        angles = torch.outer(torch.arange(n, dtype=x.dtype), inv).repeat(1, 2)  # [n, d]
        q = q * angles.cos() + rotate_half(q) * angles.sin()
        k = k * angles.cos() + rotate_half(k) * angles.sin()
        q, k = self.q_norm(q), self.k_norm(k)  # on the rotated heads
        k = k.repeat_interleave(self.h // self.kv, dim=1)
        v = v.repeat_interleave(self.h // self.kv, dim=1)
        scores = q @ k.transpose(-2, -1) / self.d ** 0.5  # [b, n_head, n, n]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        y = scores.softmax(dim=-1) @ v  # [b, n_head, n, d]
        return self.proj(y.transpose(1, 2).reshape(b, n, -1))
