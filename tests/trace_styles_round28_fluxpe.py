"""Styles of our own whose forward takes RoPE's table as 2x2 rotation matrices [[cos, -sin], [sin, cos]] for each
interleaved pair (Black Forest Labs' Flux: `attention(q, k, v, pe)`, `apply_rope`), for
tests/test_trace_round28_fluxpe.py (round 28: trace fed Flux's `pe` the tokens' positions, on which its code ran only
because n_batch was 2, the pair's size). Weights moved off their initial values (norm scales too).

- FluxAttention: Flux's SelfAttention, `forward(x, pe)`, pe [n_batch, 1, n, d_head / 2, 2, 2] as EmbedND makes it;
  fused qkv, QK RMSNorm per head, apply_rope's `pe[..., 0] * x_[..., 0] + pe[..., 1] * x_[..., 1]`, F.sdpa.
- EinsumRotary: the same table written otherwise: `rot` [n_batch, n, 1, d_head / 2, 2, 2] beside q laid tokens
  first [n_batch, n, n_head, d_head], each pair turned by `torch.einsum("...ij,...j->...i", rot, pairs)`; separate
  projections, scores by matmul and softmax.
- ThreeTerms: a table of three values a coordinate multiplied into q and k, [n_batch, 1, n, d_head, 3]: no form of
  RoPE's table trace knows (the error line says what was tried).

`bug` for each: 'k_unrotated' (the rotated keys dropped), FluxAttention 'kv_swapped' (sdpa(q, v, k)), EinsumRotary
'no_scale' (scores never scaled).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))


def flux_table(n_batch: int, n: int, d_head: int, theta: float = 10000.0) -> torch.Tensor:
    """Flux's EmbedND over 1-D positions 0 .. n - 1: [n_batch, 1, n, d_head / 2, 2, 2]."""
    pos = torch.arange(n, dtype=torch.float64).repeat(n_batch, 1)
    omega = 1.0 / theta ** (torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
    out = torch.einsum("...n,d->...nd", pos, omega)
    out = torch.stack([out.cos(), -out.sin(), out.sin(), out.cos()], dim=-1)
    return out.view(*out.shape[:-1], 2, 2).unsqueeze(1)


def apply_rope(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = xq.float().reshape(*xq.shape[:-1], -1, 1, 2).to(xq.dtype)
    xk_ = xk.float().reshape(*xk.shape[:-1], -1, 1, 2).to(xk.dtype)
    xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    xk_out = freqs_cis[..., 0] * xk_[..., 0] + freqs_cis[..., 1] * xk_[..., 1]
    return xq_out.reshape(*xq.shape), xk_out.reshape(*xk.shape)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale


class FluxAttention(nn.Module):
    def __init__(self, dim: int = 32, num_heads: int = 4, bug: str = "") -> None:
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.query_norm = RMSNorm(dim // num_heads)
        self.key_norm = RMSNorm(dim // num_heads)
        self.proj = nn.Linear(dim, dim)
        _trained(self, 28)

    def forward(self, x: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = self.query_norm(q), self.key_norm(k)
        q, k_rot = apply_rope(q, k, pe)
        k = k if self.bug == "k_unrotated" else k_rot
        if self.bug == "kv_swapped":
            k, v = v, k
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.permute(0, 2, 1, 3).reshape(B, L, -1))


class EinsumRotary(nn.Module):
    def __init__(self, d_model: int = 32, n_heads: int = 4, bug: str = "") -> None:
        super().__init__()
        self.h, self.d, self.bug = n_heads, d_model // n_heads, bug
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)
        _trained(self, 29)

    @staticmethod
    def turn(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        pairs = x.unflatten(-1, (-1, 2))  # [b, n, h, d/2, 2]
        return torch.einsum("...ij,...j->...i", rot, pairs).flatten(-2)

    def forward(self, hidden: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        b, n, _ = hidden.shape
        q = self.wq(hidden).view(b, n, self.h, self.d)
        k = self.wk(hidden).view(b, n, self.h, self.d)
        v = self.wv(hidden).view(b, n, self.h, self.d).transpose(1, 2)
        q = self.turn(q, rot).transpose(1, 2)
        k = (k if self.bug == "k_unrotated" else self.turn(k, rot)).transpose(1, 2)
        scores = q @ k.transpose(-2, -1)
        if self.bug != "no_scale":
            scores = scores / math.sqrt(self.d)
        out = scores.softmax(dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


class ThreeTerms(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        _trained(self, 30)

    def forward(self, x: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        t = pe.unsqueeze(1)  # [b, 1, n, d, 3]
        q = q * t[..., 0] + q.flip(-1) * t[..., 1] + t[..., 2]
        k = k * t[..., 0] + k.flip(-1) * t[..., 1] + t[..., 2]
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))
