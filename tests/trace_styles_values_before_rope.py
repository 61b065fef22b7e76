"""Grouped-query attention with RoPE whose plant takes the values from the key projection before the rotation
(`value_states = self.k_proj(x)`, as round 8's Cohere plant did): tests/test_trace_values_before_rope.py."""

import torch
import torch.nn.functional as F
from torch import nn


class RopeGQA(nn.Module):
    """HF-like: q/k/v projections viewed to heads, RoPE on q and k (`pairing`: half-split's rotate_half or
    interleaved pairs), the keys and values repeated per group, an explicit softmax."""

    def __init__(self, d_model=32, n_heads=4, n_kv_heads=2, pairing="half", bug=""):
        super().__init__()
        self.h, self.kv, self.d = n_heads, n_kv_heads, d_model // n_heads
        self.pairing, self.bug = pairing, bug
        self.q_proj = nn.Linear(d_model, n_heads * self.d, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.d, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.d, bias=False)
        self.o_proj = nn.Linear(n_heads * self.d, d_model, bias=False)

    def rotate(self, x):
        n = x.shape[-2]
        inv = 1.0 / (10000 ** (torch.arange(0, self.d, 2, dtype=x.dtype) / self.d))
        angles = torch.arange(n, dtype=x.dtype)[:, None] * inv  # [n, d/2]
        if self.pairing == "half":
            cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
            x1, x2 = x[..., : self.d // 2], x[..., self.d // 2:]
            return x * cos + torch.cat([-x2, x1], -1) * sin
        pairs = x.unflatten(-1, (-1, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack([a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()], -1).flatten(-2)

    def forward(self, x):
        B, n, _ = x.shape
        q = self.q_proj(x).view(B, n, -1, self.d)
        k = self.k_proj(x).view(B, n, -1, self.d)
        v = (self.k_proj if self.bug == "v_from_k" else self.v_proj)(x).view(B, n, -1, self.d).transpose(1, 2)
        q, k = self.rotate(q.transpose(1, 2)), self.rotate(k.transpose(1, 2))
        k, v = repeat_kv(k, self.h // self.kv), repeat_kv(v, self.h // self.kv)
        scores = q @ k.transpose(-2, -1) / self.d ** 0.5
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        weights = F.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        return self.o_proj((weights @ v).transpose(1, 2).reshape(B, n, -1))


def repeat_kv(x, n_rep):
    """transformers' repeat_kv: [B, n_kv, n, d] -> [B, n_kv·n_rep, n, d], each head's copies side by side."""
    B, n_kv, n, d = x.shape
    return x[:, :, None].expand(B, n_kv, n_rep, n, d).reshape(B, n_kv * n_rep, n, d)
