"""Styles of our own whose qk-norm is one norm per head, for tests/test_trace_round21_headnorms.py (round 21's
StableLM: a ModuleList of nn.LayerNorm(d_head), each head through its own). Weights moved off their initial values.

- SplitNorms: a ModuleList of LayerNorm(d_head) over `q.split(1, dim=1)`, joined by torch.cat; half-split RoPE on
  the normed heads, grouped keys (repeat_interleave). `bug`: 'after_rope' (the norms after RoPE), 'tiled' (the key
  heads tiled, .repeat).
- LoopedRMS: nn.RMSNorm(d_head) per head in a ModuleList, applied in a loop over `[n_batch, n, n_head, d_head]` from the
  last head to the first, each written back at its head (`out[:, :, h] = norm(q[:, :, h])`: the container's order is
  not the heads'). `bug`: 'no_scale'.
- StackedNorm: one module holding `[n_head, d_head]` weight and bias, applied head by head (`F.layer_norm(x[:, h],
  (d,), self.weight[h], self.bias[h])`) and stacked; RoPE. `bug`: 'after_rope', 'no_scale'.
- GainList: no norm module, per-head gains and biases in nn.ParameterList passed to F.layer_norm in a loop over the
  heads. `bug`: 'no_scale'.
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


def rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Half-split RoPE over [.., n, d] (the tokens on axis -2)."""
    n, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    cos, sin = torch.cat((angles, angles), -1).cos().to(x.dtype), torch.cat((angles, angles), -1).sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


class HeadNorms(nn.Module):
    def __init__(self, d_head: int, n: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(d_head, eps=1e-5) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([norm(part) for norm, part in zip(self.norms, x.split(1, dim=1), strict=True)], dim=1)


class SplitNorms(nn.Module):
    def __init__(self, d_model: int = 32, n_head: int = 4, n_kv_head: int = 2, bug: str = "") -> None:
        super().__init__()
        self.h, self.g, self.d, self.bug = n_head, n_kv_head, d_model // n_head, bug
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, n_kv_head * self.d)
        self.v_proj = nn.Linear(d_model, n_kv_head * self.d)
        self.o_proj = nn.Linear(d_model, d_model)
        self.q_norm = HeadNorms(self.d, n_head)
        self.k_norm = HeadNorms(self.d, n_kv_head)
        trained(self, 21)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.g, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.g, self.d).transpose(1, 2)
        if self.bug != "after_rope":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q), rope(k)
        if self.bug == "after_rope":
            q, k = self.q_norm(q), self.k_norm(k)
        rep = self.h // self.g
        if self.bug == "tiled":
            k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
        else:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        w = (q @ k.transpose(-1, -2) / self.d ** 0.5).softmax(-1)
        return self.o_proj((w @ v).transpose(1, 2).reshape(b, n, -1))


class LoopedRMS(nn.Module):
    def __init__(self, dim: int = 24, heads: int = 3, bug: str = "") -> None:
        super().__init__()
        self.heads, self.d, self.bug = heads, dim // heads, bug
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.q_norms = nn.ModuleList([nn.RMSNorm(self.d, eps=1e-6) for _ in range(heads)])
        self.k_norms = nn.ModuleList([nn.RMSNorm(self.d, eps=1e-6) for _ in range(heads)])
        trained(self, 5)

    def _normed(self, t: torch.Tensor, norms: nn.ModuleList) -> torch.Tensor:
        out = torch.zeros_like(t)
        for h in reversed(range(self.heads)):
            out[:, :, h] = norms[h](t[:, :, h])
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (w(x).view(b, n, self.heads, self.d) for w in (self.wq, self.wk, self.wv))
        q, k = self._normed(q, self.q_norms), self._normed(k, self.k_norms)
        scores = torch.einsum("bihd,bjhd->bhij", q, k)
        if self.bug != "no_scale":
            scores = scores * self.d ** -0.5
        out = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v)
        return self.wo(out.reshape(b, n, -1))


class PerHeadLayerNorm(nn.Module):
    def __init__(self, heads: int, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, d))
        self.bias = nn.Parameter(torch.zeros(heads, d))
        self.eps = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [.., heads, n, d] with the heads on axis 1
        return torch.stack([F.layer_norm(x[:, h], (x.shape[-1],), self.weight[h], self.bias[h], self.eps)
                            for h in range(self.weight.shape[0])], dim=1)


class StackedNorm(nn.Module):
    def __init__(self, d_model: int = 32, n_head: int = 4, bug: str = "") -> None:
        super().__init__()
        self.h, self.d, self.bug = n_head, d_model // n_head, bug
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.q_norm = PerHeadLayerNorm(n_head, self.d)
        self.k_norm = PerHeadLayerNorm(n_head, self.d)
        trained(self, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.h, self.d).permute(2, 0, 3, 1, 4).unbind(0)
        if self.bug != "after_rope":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q), rope(k)
        if self.bug == "after_rope":
            q, k = self.q_norm(q), self.k_norm(k)
        scores = q @ k.transpose(-2, -1)
        if self.bug != "no_scale":
            scores = scores / self.d ** 0.5
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)
        out = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class GainList(nn.Module):
    """Per-head gains and biases as nn.ParameterList, no norm module: `F.layer_norm(q[:, h], (d,), w[h], b[h])` in a
    loop over `[n_batch, n_head, n, d_head]`, stacked back. `bug`: 'no_scale'."""

    def __init__(self, d_model: int = 32, n_head: int = 4, bug: str = "") -> None:
        super().__init__()
        self.h, self.d, self.bug = n_head, d_model // n_head, bug
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))
        self.q_gain = nn.ParameterList([nn.Parameter(torch.ones(self.d)) for _ in range(n_head)])
        self.q_shift = nn.ParameterList([nn.Parameter(torch.zeros(self.d)) for _ in range(n_head)])
        self.k_gain = nn.ParameterList([nn.Parameter(torch.ones(self.d)) for _ in range(n_head)])
        self.k_shift = nn.ParameterList([nn.Parameter(torch.zeros(self.d)) for _ in range(n_head)])
        trained(self, 17)

    def _normed(self, t: torch.Tensor, gains: nn.ParameterList, shifts: nn.ParameterList) -> torch.Tensor:
        return torch.stack([F.layer_norm(t[:, h], (self.d,), gains[h], shifts[h], 1e-5) for h in range(self.h)], 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = (p(x).view(b, n, self.h, self.d).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = self._normed(q, self.q_gain, self.q_shift), self._normed(k, self.k_gain, self.k_shift)
        scores = q @ k.transpose(-2, -1)
        if self.bug != "no_scale":
            scores = scores / self.d ** 0.5
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))
