"""Attention modules for tests/test_trace_f12_kv.py.

Fused projections whose bias says which block is the keys' (a constant-zero block beside learned ones), in the
forms BEiT / Swin v2 (`cat(q_bias, zeros_like(v_bias), v_bias)`), EVA (a zero buffer `k_bias`), a chunked
`qkv_bias` parameter with its k part replaced by `new_zeros`, and a fused K/V projection beside a Q one: each with
the plant `kv_renamed`, the unpacking of the fused output naming k and v the other way round.

Modules whose attention output gets a term of their own beside `attn @ v`: Shaw et al.'s relative position
values (`attn @ rel_v` per query row, an einsum), a learned output bias per query position, and a gated
per-head value term; each with planted mistakes elsewhere (scale, softmax axis, mask).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _moved(*params: torch.Tensor, seed: int = 3) -> None:
    """Parameters off their init, as a trained model's are (a zero bias would hide which block is which)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


class CatZerosBias(nn.Module):
    """BEiT / Swin v2: no bias in the Linear, q_bias and v_bias parameters, the keys' part zeros_like."""

    def __init__(self, dim: int = 32, num_heads: int = 4, bug: str | None = None, key_bias: bool = False) -> None:
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.k_bias = nn.Parameter(torch.zeros(dim)) if key_bias else None  # a learned one: blocks alike
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.proj = nn.Linear(dim, dim)
        _moved(*(p for p in (self.q_bias, self.k_bias, self.v_bias) if p is not None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        k_bias = self.k_bias if self.k_bias is not None else torch.zeros_like(self.v_bias, requires_grad=False)
        qkv_bias = torch.cat((self.q_bias, k_bias, self.v_bias))
        qkv = F.linear(input=x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        if self.bug == "kv_renamed":
            q, v, k = qkv.unbind(0)
        else:
            q, k, v = qkv.unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class ZeroBufferBias(nn.Module):
    """EVA: the keys' bias a zero buffer, the three concatenated; a packed axis of 3 unbound."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str | None = None) -> None:
        super().__init__()
        self.heads, self.bug = heads, bug
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.out = nn.Linear(dim, dim)
        _moved(self.q_bias, self.v_bias, seed=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = F.linear(x, self.qkv.weight, torch.cat((self.q_bias, self.k_bias, self.v_bias)))
        qkv = qkv.view(b, n, 3, self.heads, d // self.heads).transpose(1, 3)  # [b, h, 3, n, d_head]
        if self.bug == "kv_renamed":
            q, v, k = qkv.unbind(2)
        else:
            q, k, v = qkv.unbind(2)
        w = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // self.heads), dim=-1)
        return self.out(torch.matmul(w, v).transpose(1, 2).reshape(b, n, d))


class ChunkedParamBias(nn.Module):
    """One weight `[d, 3d]` used as `x @ W + b`, its bias a learned `[3d]` whose k chunk the code replaces with
    `new_zeros`; heads by einsum."""

    def __init__(self, d_model: int = 32, n_heads: int = 4, bug: str | None = None) -> None:
        super().__init__()
        self.h, self.bug = n_heads, bug
        self.w_qkv = nn.Parameter(torch.randn(d_model, 3 * d_model) / math.sqrt(d_model))
        self.b_qkv = nn.Parameter(torch.zeros(3 * d_model))
        self.w_out = nn.Linear(d_model, d_model)
        _moved(self.b_qkv, seed=5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n_batch, n, d = x.shape
        b_q, b_k, b_v = self.b_qkv.chunk(3)
        y = x @ self.w_qkv + torch.cat([b_q, b_k.new_zeros(b_k.shape), b_v])
        if self.bug == "kv_renamed":
            q, v, k = y.split(d, dim=-1)
        else:
            q, k, v = y.split(d, dim=-1)
        q, k, v = (t.view(n_batch, n, self.h, d // self.h) for t in (q, k, v))
        att = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.h)
        att = att.softmax(-1)
        out = torch.einsum("bhqk,bkhd->bqhd", att, v)
        return self.w_out(out.reshape(n_batch, n, d))


class KVZeroBias(nn.Module):
    """A fused K/V projection beside a Q one (x-transformers' `to_kv`), its bias `cat(zeros, v_bias)`."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str | None = None) -> None:
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_q = nn.Linear(dim, dim)
        self.to_kv = nn.Linear(dim, 2 * dim, bias=False)
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.to_out = nn.Linear(dim, dim)
        _moved(self.v_bias, seed=6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q = self.to_q(x)
        bias = torch.cat([torch.zeros(d, dtype=x.dtype, device=x.device), self.v_bias])
        kv = F.linear(x, self.to_kv.weight, bias)
        if self.bug == "kv_renamed":
            v, k = kv.chunk(2, dim=-1)
        else:
            k, v = kv.chunk(2, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for t in (q, k, v))
        dots = torch.matmul(q, k.transpose(-1, -2)) * (d // self.heads) ** -0.5
        out = torch.matmul(dots.softmax(dim=-1), v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, d))
