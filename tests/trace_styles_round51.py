"""Two styles of held-out round 51's findings, written afresh for tests/test_trace_round51.py.

- `NormedRopeAttention`: q and k normed per head by torch's own nn.RMSNorm (gains of 1 as built), then RoPE
  (half-split, base 10000), causal, GQA 4/2. `bug="norm_after_rope"` norms after the rotation: with unit gains the
  two orders give the same numbers (a rotation keeps a row's length), with trained gains they do not.
- `KeyMultiplierAttention`: Falcon-H1's key multiplier, k = k_proj(x) · 0.25 before RoPE, the usual 1/√d_head on
  the scores (so the whole scale is 0.25/√d_head, told with --scale). `bug="kv_swapped"` hands the attention
  (q, v, k) after RoPE.
"""

import math

import torch
from torch import nn


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def rope(x, base=10000.0):
    """Half-split RoPE of [batch, heads, n, d] at positions 0..n-1."""
    n, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = torch.outer(torch.arange(n, dtype=torch.float32, device=x.device), inv)
    angles = torch.cat((angles, angles), dim=-1).to(x.dtype)
    return x * angles.cos() + rotate_half(x) * angles.sin()


def causal_attention(q, k, v, scale):
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    n_q, n_k = scores.shape[-2:]
    keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
    scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)


class NormedRopeAttention(nn.Module):
    def __init__(self, dim=48, n_heads=4, n_kv=2, bug=None):
        super().__init__()
        self.n_heads, self.n_kv, self.d = n_heads, n_kv, dim // n_heads
        self.bug = bug
        self.wq = nn.Linear(dim, n_heads * self.d, bias=False)
        self.wk = nn.Linear(dim, n_kv * self.d, bias=False)
        self.wv = nn.Linear(dim, n_kv * self.d, bias=False)
        self.wo = nn.Linear(n_heads * self.d, dim, bias=False)
        self.q_norm = nn.RMSNorm(self.d, eps=1e-6)
        self.k_norm = nn.RMSNorm(self.d, eps=1e-6)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.n_heads, self.d).transpose(1, 2)
        k = self.wk(x).view(b, n, self.n_kv, self.d).transpose(1, 2)
        v = self.wv(x).view(b, n, self.n_kv, self.d).transpose(1, 2)
        if self.bug == "norm_after_rope":
            q, k = self.q_norm(rope(q)), self.k_norm(rope(k))
        else:
            q, k = rope(self.q_norm(q)), rope(self.k_norm(k))
        k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        out = causal_attention(q, k, v, 1 / math.sqrt(self.d))
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


class KeyMultiplierAttention(nn.Module):
    def __init__(self, dim=32, n_heads=4, key_multiplier=0.25, bug=None):
        super().__init__()
        self.n_heads, self.d, self.key_multiplier, self.bug = n_heads, dim // n_heads, key_multiplier, bug
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        split = (b, n, self.n_heads, self.d)
        q = self.q_proj(hidden_states).view(split).transpose(1, 2)
        k = (self.k_proj(hidden_states) * self.key_multiplier).view(split).transpose(1, 2)
        v = self.v_proj(hidden_states).view(split).transpose(1, 2)
        q, k = rope(q), rope(k)
        if self.bug == "kv_swapped":
            k, v = v, k
        out = causal_attention(q, k, v, self.d ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))
