"""A Gemma-3n-like attention in a from-scratch style (tests/test_trace_round31_vnorm.py): heads moved first, then
each head RMS-normed (q and k with gains, v with none, a module that holds no state at all), RoPE made in the forward
from its own frequencies, grouped key/value heads, causal, and no 1/sqrt(d) (the norms stand in for it). `bug` plants
one mistake: "k_unnormed" (norm_k never applied), "rope_first" (q and k rotated, then normed) or "v_idle" (norm_v
held, never called). `IdleGateAttention` holds a value norm it legitimately leaves unused (a switch off)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter moved off its initial value (unit gains and zero biases hide mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return module


class HeadRMS(nn.Module):
    """x · rsqrt(mean(x²) + eps) over the last axis, in float32, then times a gain where `gain` (no state without)."""

    def __init__(self, width: int, gain: bool = True, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.g = nn.Parameter(torch.ones(width)) if gain else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        if self.g is not None:
            y = y * self.g.float()
        return y.type_as(x)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class NormedValueAttention(nn.Module):
    def __init__(self, width: int = 48, n_heads: int = 4, n_groups: int = 2, base: float = 10000.0,
                 bug: str | None = None):
        super().__init__()
        self.h, self.g, self.d, self.base, self.bug = n_heads, n_groups, width // n_heads, base, bug
        self.wq = nn.Linear(width, n_heads * self.d)
        self.wk = nn.Linear(width, n_groups * self.d)
        self.wv = nn.Linear(width, n_groups * self.d)
        self.wo = nn.Linear(n_heads * self.d, width)
        self.norm_q, self.norm_k = HeadRMS(self.d), HeadRMS(self.d)
        self.norm_v = HeadRMS(self.d, gain=False)
        _trained(self, 31)

    def _angles(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = self.base ** (-torch.arange(0, self.d, 2, dtype=torch.float32) / self.d)
        turns = torch.outer(torch.arange(n, dtype=torch.float32), freqs)
        both = torch.cat((turns, turns), -1)
        return both.cos().to(like.dtype), both.sin().to(like.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.wq(x).reshape(b, n, self.h, self.d).permute(0, 2, 1, 3)
        k = self.wk(x).reshape(b, n, self.g, self.d).permute(0, 2, 1, 3)
        v = self.wv(x).reshape(b, n, self.g, self.d).permute(0, 2, 1, 3)
        cos, sin = self._angles(n, x)
        if self.bug == "rope_first":
            q, k = self.norm_q(_turn(q, cos, sin)), self.norm_k(_turn(k, cos, sin))
        else:
            q = _turn(self.norm_q(q), cos, sin)
            k = _turn(k if self.bug == "k_unnormed" else self.norm_k(k), cos, sin)
        if self.bug != "v_idle":
            v = self.norm_v(v)
        k = k.repeat_interleave(self.h // self.g, dim=1)
        v = v.repeat_interleave(self.h // self.g, dim=1)
        s = q @ k.transpose(-1, -2)
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        p = s.masked_fill(future, float("-inf")).softmax(-1)
        return self.wo((p @ v).permute(0, 2, 1, 3).reshape(b, n, self.h * self.d))


class IdleGateAttention(nn.Module):
    """Plain multi-head attention scaled by 1/sqrt(d) that holds a value norm for a switch it leaves off: correct."""

    def __init__(self, width: int = 32, n_heads: int = 4, norm_values: bool = False):
        super().__init__()
        self.h, self.d, self.norm_values = n_heads, width // n_heads, norm_values
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.value_norm = nn.RMSNorm(self.d, eps=1e-6, elementwise_affine=False)
        _trained(self, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.d).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.norm_values:
            v = self.value_norm(v)
        y = F.softmax(q @ k.transpose(-2, -1) / self.d ** 0.5, dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, n, e))
