"""Styles of our own for tests/test_trace_round22_groups.py: grouped-query attention written as an einsum over the
query heads regrouped (round 22's DBRX group_order plant), beside a half-split RoPE whose rotate_half is a torch.cat
of the queries (as wide as the repeated keys). Weights moved off their initial values.

- RotaryGroupedEinsum: q `[B, h, n, d]` viewed as `[B, n_kv, g, n, d]` (query heads h·g .. h·g + g − 1 on key/value
  head h), scores `einsum('bkgqd,bksd->bkgqs')`, causal. `bug`: 'group_order' (q viewed `[B, g, n_kv, n, d]`, the
  einsum 'bgkqd,bksd->bgkqs'), 'tiled' (the keys and values `.repeat(1, g, 1, 1)`, plain matmuls).
- SplitGroups: the heads last, `[B, n, h, d]`, q regrouped by views and `torch.einsum('bqkgd,bskd->bkgqs')`, no RoPE,
  n_group 3 beside n_kv_head 2. `bug`: 'tiled' (`k.repeat(1, 1, g, 1)`).
"""

from __future__ import annotations

import torch
from torch import nn


def trained(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


def rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Half-split RoPE over [.., n, d] (the tokens on axis -2)."""
    n, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    cos, sin = torch.cat((angles, angles), -1).cos().to(x.dtype), torch.cat((angles, angles), -1).sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


class RotaryGroupedEinsum(nn.Module):
    def __init__(self, d_model=32, n_head=4, n_kv_head=2, bug=""):
        super().__init__()
        self.h, self.kv, self.d, self.bug = n_head, n_kv_head, d_model // n_head, bug
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, n_kv_head * self.d, bias=False)
        self.wv = nn.Linear(d_model, n_kv_head * self.d, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)
        trained(self, 22)

    def forward(self, x):
        b, n, _ = x.shape
        g = self.h // self.kv
        q = rope(self.wq(x).view(b, n, self.h, self.d).transpose(1, 2))  # [B, h, n, d]
        k = rope(self.wk(x).view(b, n, self.kv, self.d).transpose(1, 2))  # [B, n_kv, n, d]
        v = self.wv(x).view(b, n, self.kv, self.d).transpose(1, 2)
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        if self.bug == "tiled":
            k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)  # [B, h, n, d]
            att = (q @ k.transpose(-2, -1)) / self.d ** 0.5
            o = att.masked_fill(causal, float("-inf")).softmax(-1) @ v  # [B, h, n, d]
        else:
            if self.bug == "group_order":
                qg = q.reshape(b, g, self.kv, n, self.d)
                att = torch.einsum("bgkqd,bksd->bgkqs", qg, k) / self.d ** 0.5
            else:
                qg = q.reshape(b, self.kv, g, n, self.d)
                att = torch.einsum("bkgqd,bksd->bkgqs", qg, k) / self.d ** 0.5
            att = att.masked_fill(causal, float("-inf")).softmax(-1)
            spec = "bgkqs,bksd->bgkqd" if self.bug == "group_order" else "bkgqs,bksd->bkgqd"
            o = torch.einsum(spec, att, v).reshape(b, self.h, n, self.d)
        return self.wo(o.transpose(1, 2).reshape(b, n, -1))


class SplitGroups(nn.Module):
    def __init__(self, d_model=48, n_head=6, n_kv_head=2, bug=""):
        super().__init__()
        self.h, self.kv, self.d, self.bug = n_head, n_kv_head, d_model // n_head, bug
        self.qkv = nn.Linear(d_model, d_model + 2 * n_kv_head * self.d)
        self.out = nn.Linear(d_model, d_model)
        trained(self, 23)

    def forward(self, x):
        b, n, _ = x.shape
        g = self.h // self.kv
        q, k, v = self.qkv(x).split([self.h * self.d, self.kv * self.d, self.kv * self.d], -1)
        q = q.view(b, n, self.h, self.d)  # [B, n, h, d]
        k, v = k.view(b, n, self.kv, self.d), v.view(b, n, self.kv, self.d)  # [B, n, n_kv, d]
        if self.bug == "tiled":
            k, v = k.repeat(1, 1, g, 1), v.repeat(1, 1, g, 1)  # [B, n, h, d]
            att = torch.einsum("bqhd,bshd->bhqs", q, k) * self.d ** -0.5
            o = torch.einsum("bhqs,bshd->bqhd", att.softmax(-1), v)
            return self.out(o.reshape(b, n, -1))
        qg = q.view(b, n, self.kv, g, self.d)  # [B, n, n_kv, g, d]
        att = torch.einsum("bqkgd,bskd->bkgqs", qg, k) * self.d ** -0.5
        o = torch.einsum("bkgqs,bskd->bqkgd", att.softmax(-1), v)  # [B, n, n_kv, g, d]
        return self.out(o.reshape(b, n, -1))
