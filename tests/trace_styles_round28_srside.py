"""Styles for tests/test_trace_round28_srside.py: keys and values read a tensor the module makes from its input
through a layer of its own that is no role's projection, then q, k and v Linear layers (or a fused kv one).

- `PoolConvKV`: PVT-v2's linear spatial reduction laid as a sequence: `AdaptiveAvgPool1d` over `[B, C, N]`, a
  pointwise `nn.Conv1d(dim, dim, 1)` (`sr`), LayerNorm and GELU, then `k` and `v` Linear layers, or one fused `kv`
  cut by a view and a permute (`fused=True`).
- `MemoryLinear`: a pooled memory passed through an nn.Linear of its own (`mem`) and tanh before `k` and `v`.
- `KeysFromQueries`: a plant, not a convention: the key projection reads the projected queries (`self.k(q_feat)`).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from _trace_ref import trained


class PoolConvKV(nn.Module):
    def __init__(self, dim=32, heads=4, pooled=5, fused=False, bug=None):
        super().__init__()
        self.heads, self.fused, self.bug = heads, fused, bug
        self.q = nn.Linear(dim, dim)
        if fused:
            self.kv = nn.Linear(dim, 2 * dim)
        else:
            self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.pool = nn.AdaptiveAvgPool1d(pooled)
        self.sr = nn.Conv1d(dim, dim, 1)
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)
        trained(self, 28)

    def forward(self, x):
        B, N, C = x.shape
        h, d = self.heads, C // self.heads
        q = self.q(x).view(B, N, h, d).transpose(1, 2)
        x_ = self.sr(self.pool(x.transpose(1, 2))).transpose(1, 2)
        x_ = F.gelu(self.norm(x_))
        if self.fused:
            k, v = self.kv(x_).view(B, -1, 2, h, d).permute(2, 0, 3, 1, 4)
        else:
            k = self.k(x_).view(B, -1, h, d).transpose(1, 2)
            v = self.v(x_).view(B, -1, h, d).transpose(1, 2)
        if self.bug == "kv_swapped":
            k, v = v, k
        scores = q @ k.transpose(-2, -1)
        attn = (scores if self.bug == "no_scale" else scores * d ** -0.5).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class MemoryLinear(nn.Module):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.mem = nn.Linear(dim, dim)
        trained(self, 29)

    def forward(self, x):
        B, N, C = x.shape
        h, d = self.heads, C // self.heads
        m = torch.tanh(self.mem(F.avg_pool1d(x.transpose(1, 2), 2).transpose(1, 2)))
        q = self.q(x).view(B, N, h, d).transpose(1, 2)
        k = self.k(m).view(B, -1, h, d).transpose(1, 2)
        v = self.v(m).view(B, -1, h, d).transpose(1, 2)
        attn = (q @ k.transpose(-2, -1) * d ** -0.5).softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        return self.o((attn @ v).transpose(1, 2).reshape(B, N, C))


class KeysFromQueries(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        trained(self, 30)

    def forward(self, x):
        B, N, C = x.shape
        h, d = self.heads, C // self.heads
        q_feat = self.q(x)
        q = q_feat.view(B, N, h, d).transpose(1, 2)
        k = self.k(q_feat).view(B, N, h, d).transpose(1, 2)  # the plant: keys from the projected queries
        v = self.v(x).view(B, N, h, d).transpose(1, 2)
        attn = (q @ k.transpose(-2, -1) * d ** -0.5).softmax(dim=-1)
        return self.o((attn @ v).transpose(1, 2).reshape(B, N, C))
