"""Styles of our own that set the masked weights back to 0 after the softmax (a convention: ESPnet's
`torch.softmax(scores, -1).masked_fill(mask, 0.0)`), for tests/test_trace_round21_zeroed.py. Weights moved off their
initial values. Each takes (query, key, value, mask) or (x, mask), the mask True = a real key.

- EspStyle: forward(query, key, value, mask [n_batch, 1, n_K]); scores filled with finfo.min where `mask.eq(0)`,
  softmax, the same cells set to 0. `bug`: 'softmax_axis' (softmax over the queries).
- WenetStyle: forward(x, mask [n_batch, 1, n_K]); filled with -inf, softmax, `masked_fill(mask, 0.0)` (a column of
  NaN a softmax over the queries makes is zeroed too). `bug`: 'softmax_axis', 'no_scale'.
- ZeroedPadding: forward(x, attention_mask [n_batch, n_K]); einsum scores, `masked_fill(~keep, -1e9)`, softmax, then
  `weights * keep` (a multiply, not a fill). `bug`: 'softmax_axis'.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def trained(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


class EspStyle(nn.Module):
    def __init__(self, n_head: int = 4, n_feat: int = 32, bug: str = "") -> None:
        super().__init__()
        self.h, self.d_k, self.bug = n_head, n_feat // n_head, bug
        self.linear_q, self.linear_k, self.linear_v, self.linear_out = (nn.Linear(n_feat, n_feat) for _ in range(4))
        trained(self, 3)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b = query.size(0)
        q = self.linear_q(query).view(b, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(b, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(b, -1, self.h, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        masked = mask.unsqueeze(1).eq(0)
        scores = scores.masked_fill(masked, torch.finfo(scores.dtype).min)
        attn = torch.softmax(scores, dim=-2 if self.bug == "softmax_axis" else -1).masked_fill(masked, 0.0)
        x = torch.matmul(attn, v).transpose(1, 2).contiguous().view(b, -1, self.h * self.d_k)
        return self.linear_out(x)


class WenetStyle(nn.Module):
    def __init__(self, dim: int = 24, heads: int = 3, bug: str = "") -> None:
        super().__init__()
        self.heads, self.d, self.bug = heads, dim // heads, bug
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        trained(self, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, self.d).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2)
        if self.bug != "no_scale":
            scores = scores / math.sqrt(self.d)
        pad = (mask == 0).unsqueeze(1)  # [n_batch, 1, 1, n_K]
        scores = scores.masked_fill(pad, -float("inf"))
        attn = scores.softmax(dim=2 if self.bug == "softmax_axis" else 3).masked_fill(pad, 0.0)
        return self.out((attn @ v).transpose(1, 2).reshape(b, n, c))


class ZeroedPadding(nn.Module):
    def __init__(self, d_model: int = 32, n_head: int = 4, bug: str = "") -> None:
        super().__init__()
        self.h, self.d, self.bug = n_head, d_model // n_head, bug
        self.wq, self.wk, self.wv = (nn.Linear(d_model, d_model, bias=False) for _ in range(3))
        self.wo = nn.Linear(d_model, d_model)
        trained(self, 13)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = (w(x).view(b, n, self.h, self.d) for w in (self.wq, self.wk, self.wv))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * self.d ** -0.5
        keep = attention_mask[:, None, None, :].to(torch.bool)
        weights = scores.masked_fill(~keep, -1e9).softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        weights = weights * keep
        return self.wo(torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, n, c))
