"""Styles of our own whose queries, keys or values are pooled after their projection and head split, each head's
tokens a grid (round 22's MViTv2 MultiScaleAttention), for tests/test_trace_round22_pooling.py. Weights moved off
their initial values.

- GridPooling: MViTv1/v2-like on an image `[B, H, W, C]`: three Linears, heads as `[B·h, d, H, W]`; the queries
  max-pooled (nn.MaxPool2d(3, stride_q, 1)), the keys and values each by a depthwise strided nn.Conv2d and a
  LayerNorm of each head; residual pooling (`out + q`, the pooled queries added back per head) where asked.
- AvgPooledKV: PVT-v2/PoolFormer-like on tokens `[B, N, C]` of a known grid: a fused key/value Linear, each head's
  keys and values average-pooled 2×2 (nn.AvgPool2d) after the split; the queries every token.
- FunctionalPool: functional code, heads in the batch, a fused qkv; `F.conv2d` with a depthwise weight of the module
  (stride 2) on the keys and values and `F.layer_norm` with its own gains, the queries through a stride-1 depthwise
  conv (their length kept).

`bug`: 'scale_twice' (q scaled, then the scores), 'softmax_axis' (over the queries), 'merge_wrong_permute' (heads
merged as [B, n, d, h]), 'no_scale'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def trained(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bug: str) -> torch.Tensor:
    """softmax(q kᵀ · scale) v over [.., n, d], with the planted mistakes."""
    if bug == "scale_twice":
        q = q * scale
    scores = q @ k.transpose(-2, -1)  # [.., n_Q, n_K]
    if bug != "no_scale":
        scores = scores * scale
    return scores.softmax(dim=-2 if bug == "softmax_axis" else -1) @ v  # [.., n_Q, d]


class GridPooling(nn.Module):
    def __init__(self, dim=32, heads=4, stride_q=1, residual=True, bug=""):
        super().__init__()
        self.heads, self.d, self.residual, self.bug = heads, dim // heads, residual, bug
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.pool_q = nn.MaxPool2d(3, stride_q, 1)
        self.pool_k = nn.Conv2d(self.d, self.d, 3, 2, 1, groups=self.d, bias=False)
        self.pool_v = nn.Conv2d(self.d, self.d, 3, 2, 1, groups=self.d, bias=False)
        self.norm_k, self.norm_v = nn.LayerNorm(self.d), nn.LayerNorm(self.d)
        self.out = nn.Linear(dim, dim)
        trained(self, 1)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:  # [B, H, W, C] -> [B·h, d, H, W]
        b, hh, ww, _ = t.shape
        return t.view(b, hh, ww, self.heads, self.d).permute(0, 3, 4, 1, 2).reshape(b * self.heads, self.d, hh, ww)

    def forward(self, x):
        b = x.shape[0]
        q = self.pool_q(self._heads(self.to_q(x))).flatten(2).transpose(1, 2)  # [B·h, n_Q, d]
        k = self.norm_k(self.pool_k(self._heads(self.to_k(x))).flatten(2).transpose(1, 2))  # [B·h, n_K, d]
        v = self.norm_v(self.pool_v(self._heads(self.to_v(x))).flatten(2).transpose(1, 2))
        o = attend(q, k, v, self.d ** -0.5, self.bug)
        if self.residual:
            o = o + q
        hq = wq = round(q.shape[1] ** 0.5)
        o = o.view(b, self.heads, hq, wq, self.d)
        o = o.permute(0, 2, 3, 4, 1) if self.bug == "merge_wrong_permute" else o.permute(0, 2, 3, 1, 4)
        return self.out(o.reshape(b, hq, wq, -1))  # [B, H', W', C]


class AvgPooledKV(nn.Module):
    def __init__(self, dim=32, heads=4, grid=(4, 4), bug=""):
        super().__init__()
        self.heads, self.d, self.grid, self.bug = heads, dim // heads, grid, bug
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.pool = nn.AvgPool2d(2)
        self.proj = nn.Linear(dim, dim)
        trained(self, 2)

    def forward(self, x):  # [B, N, C], N = H·W
        b, n, c = x.shape
        hh, ww = self.grid
        q = self.q(x).reshape(b, n, self.heads, self.d).transpose(1, 2)  # [B, h, N, d]
        kv = self.kv(x).reshape(b, hh, ww, 2, self.heads, self.d).permute(3, 0, 4, 5, 1, 2)  # [2, B, h, d, H, W]
        k, v = (self.pool(t.reshape(b * self.heads, self.d, hh, ww)) for t in kv.unbind(0))  # [B·h, d, H/2, W/2]
        k, v = (t.reshape(b, self.heads, self.d, -1).transpose(-2, -1) for t in (k, v))  # [B, h, n_K, d]
        o = attend(q, k, v, self.d ** -0.5, self.bug)  # [B, h, N, d]
        o = o.permute(0, 2, 3, 1) if self.bug == "merge_wrong_permute" else o.transpose(1, 2)
        return self.proj(o.reshape(b, n, c))


class FunctionalPool(nn.Module):
    def __init__(self, dim=32, heads=4, bug=""):
        super().__init__()
        self.heads, self.d, self.bug = heads, dim // heads, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_conv = nn.Parameter(torch.randn(self.d, 1, 3, 3) * 0.3)
        self.kv_conv = nn.Parameter(torch.randn(self.d, 1, 3, 3) * 0.3)
        self.gain, self.shift = nn.Parameter(torch.ones(self.d)), nn.Parameter(torch.zeros(self.d))
        self.o = nn.Linear(dim, dim)
        trained(self, 3)

    def forward(self, x):  # [B, H, W, C]
        b, hh, ww, c = x.shape
        qkv = self.qkv(x).view(b, hh * ww, 3, self.heads, self.d).permute(2, 0, 3, 4, 1)  # [3, B, h, d, N]
        q, k, v = (t.reshape(b * self.heads, self.d, hh, ww) for t in qkv)  # [B·h, d, H, W]
        q = F.conv2d(q, self.q_conv, padding=1, groups=self.d)
        k, v = (F.conv2d(t, self.kv_conv, stride=2, padding=1, groups=self.d) for t in (k, v))
        q, k, v = (t.flatten(2).transpose(1, 2) for t in (q, k, v))  # [B·h, n, d]
        k, v = (F.layer_norm(t, (self.d,), self.gain, self.shift) for t in (k, v))
        o = attend(q, k, v, self.d ** -0.5, self.bug).view(b, self.heads, hh * ww, self.d)
        o = o.permute(0, 2, 3, 1) if self.bug == "merge_wrong_permute" else o.transpose(1, 2)
        return self.o(o.reshape(b, hh, ww, c))
