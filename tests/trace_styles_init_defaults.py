"""Modules whose declared values (a scale's query_pre_attn_scalar, a softcap, a RoPE base) live only as defaults of
their __init__'s parameters, read into other attributes and never kept under their own names (gemma_pytorch's
`GemmaAttention(..., query_pre_attn_scalar: Optional[int] = 256, ...)` storing `self.scaling`), and a user's thin
subclass that hands its parent `*args, **kwargs`. tests/test_trace_init_defaults.py runs them."""

from __future__ import annotations

import math

import torch
from torch import nn


def _turned(t: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE, half-split pairing (transformers' rotate_half), positions from 0, over [b, h, n, d]."""
    n, d = t.shape[-2], t.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(t.dtype), torch.cat([angle.sin()] * 2, -1).to(t.dtype)
    half = torch.cat([-t[..., d // 2:], t[..., : d // 2]], -1)
    return t * cos + half * sin


class PreScaled(nn.Module):
    """gemma_pytorch-like: a fused qkv_proj split by sizes, q multiplied by `self.scaling` in place before the
    product, the scale from a default of __init__ that the module does not keep; causal by a buffer of its own."""

    def __init__(self, hidden_size: int = 32, num_heads: int = 4, head_dim: int = 8,
                 query_pre_attn_scalar: int = 12, bug: str | None = None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scaling = (head_dim if bug == "d_head" else query_pre_attn_scalar) ** -0.5
        self.qkv_proj = nn.Linear(hidden_size, 3 * num_heads * head_dim)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size)
        self.register_buffer("future", torch.ones(64, 64, dtype=torch.bool).triu(1), persistent=False)
        with torch.no_grad():
            for p in self.parameters():
                p.add_(0.05 * torch.randn_like(p)).mul_(2.0)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, n, _ = hidden_states.shape
        size = self.num_heads * self.head_dim
        xq, xk, xv = self.qkv_proj(hidden_states).split([size, size, size], dim=-1)
        xq, xk, xv = (t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2) for t in (xq, xk, xv))
        xq = xq.mul(self.scaling)
        scores = torch.matmul(xq, xk.transpose(2, 3))
        scores = scores.masked_fill(self.future[:n, :n], float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1).type_as(xq)
        return self.o_proj(torch.matmul(weights, xv).transpose(1, 2).reshape(b, n, -1))


class PreScaledWrapper(PreScaled):
    """A user's thin wrapper that hands its parent whatever it is not told (`super().__init__(*args, **kwargs)`):
    the parent's defaults are what Python binds."""

    def __init__(self, *args, dropout: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dropout(super().forward(hidden_states))


class CappedRotary(nn.Module):
    """Separate projections as an x-transformers-like block writes them: RoPE of a base that is a default of its
    __init__ (kept only as the tables it makes), scores capped at a default `attn_logit_softcapping` kept under
    another name; is_causal as a tril of its own."""

    def __init__(self, dim: int = 32, heads: int = 2, rope_theta: float = 500000.0,
                 attn_logit_softcapping: float = 20.0, bug: str | None = None):
        super().__init__()
        self.heads, self.cap, self.bug = heads, attn_logit_softcapping, bug
        self.base = 10000.0 if bug == "default_base" else rope_theta
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)
        with torch.no_grad():
            for p in self.parameters():
                p.add_(0.05 * torch.randn_like(p)).mul_(3.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).permute(0, 2, 1, 3) for f in (self.to_q, self.to_k, self.to_v))
        q, k = _turned(q, self.base), _turned(k, self.base)
        sim = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if self.bug != "no_softcap":
            sim = torch.tanh(sim / self.cap) * self.cap
        keep = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        sim = sim.masked_fill(~keep, -torch.finfo(sim.dtype).max)
        out = sim.softmax(dim=-1) @ v
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, d))
