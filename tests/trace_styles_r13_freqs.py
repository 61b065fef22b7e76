"""Styles for tests/test_trace_r13_freqs.py: RoPE whose frequencies no base gives, read from the rotated tensors
(usertrace/ropefreqs.py). Each correct form is checked in the
tests against a float64 formula with SDPA; `bug=` plants one mistake.

- `TruncatedRope`: modded-nanogpt's later form written with three Linear layers: F.rms_norm on q and k over
  [B, T, H, D], then a half-truncated RoPE (`(1/1024)^linspace(0, 1)` on the first quarter of the pairs (i, i + D/2),
  zero on the rest, turned by −θ: `y1 = x1·cos + x2·sin`), SDPA causal at a fixed scale.
- `LinspaceComplex`: Meta's complex form (`view_as_complex`, interleaved pairs) with frequencies spread log-evenly
  from 1 to 1/base over the pairs (`base^(−linspace(0, 1))`, as some JAX ports write their timescales), GQA by
  repeat_interleave, an additive causal mask.
- `PRope`: p-RoPE ("Round and round we go", Gemma 3n's rotary reduction): transformers' rotate_half with cos/sin
  tables `cat(freqs, freqs)`, the lowest quarter of the frequencies set to 0, so those pairs never turn; a
  bidirectional encoder (no mask).
- `Opposite`: q turned by +θ and k by −θ with the speedrun's table: no RoPE (q·k depends on i + j): a bug, never a
  convention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return module


def truncated_freqs(head_dim: int) -> torch.Tensor:
    """The speedrun's: (1/1024)^linspace(0, 1) on the first head_dim/4 pairs, 0 on the other head_dim/4."""
    freq = (1 / 1024) ** torch.linspace(0, 1, steps=head_dim // 4, dtype=torch.float32)
    return torch.cat([freq, freq.new_zeros(head_dim // 4)])


class TruncatedRope(nn.Module):
    def __init__(self, dim=32, n_head=4, bug=None):
        super().__init__()
        self.h, self.d, self.bug, self.scale = n_head, dim // n_head, bug, 0.12
        self.c_q = nn.Linear(dim, dim, bias=False)
        self.c_k = nn.Linear(dim, dim, bias=False)
        self.c_v = nn.Linear(dim, dim, bias=False)
        self.c_proj = nn.Linear(dim, dim, bias=False)
        theta = torch.outer(torch.arange(64, dtype=torch.float32), truncated_freqs(self.d))
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)
        _trained(self, 31)

    def rotary(self, x):  # [B, T, H, D]
        cos, sin = self.cos[None, : x.size(-3), None, :], self.sin[None, : x.size(-3), None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos), 3).type_as(x)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.h, self.d)
        k = self.c_k(x).view(B, T, self.h, self.d)
        v = self.c_v(x).view(B, T, self.h, self.d)
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        q, k = self.rotary(q), self.rotary(k)
        if self.bug == "scale_twice":
            q = q * self.scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.bug == "off_by_one":
            allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril(diagonal=1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, self.h * self.d))


def linspace_freqs(head_dim: int, base: float = 10000.0) -> torch.Tensor:
    return base ** -torch.linspace(0, 1, steps=head_dim // 2, dtype=torch.float32)


class LinspaceComplex(nn.Module):
    def __init__(self, dim=32, n_heads=4, n_kv_heads=2, bug=None):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim, self.bug = n_heads, n_kv_heads, dim // n_heads, bug
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        _trained(self, 32)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        freqs = torch.outer(torch.arange(seqlen, dtype=torch.float32), linspace_freqs(self.head_dim))
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs)  # [seqlen, head_dim / 2]
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv, self.head_dim)
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        fc = freqs_cis[None, :, None, :]
        xq = torch.view_as_real(xq_ * fc).flatten(3).type_as(x)
        xk = torch.view_as_real(xk_ * fc).flatten(3).type_as(x)
        rep = self.n_heads // self.n_kv
        if self.bug == "tiled":
            keys, values = xk.repeat(1, 1, rep, 1), xv.repeat(1, 1, rep, 1)
        else:
            keys, values = xk.repeat_interleave(rep, dim=2), xv.repeat_interleave(rep, dim=2)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        mask = torch.full((seqlen, seqlen), float("-inf"), device=x.device).triu(1)
        probs = F.softmax((scores + mask).float(), dim=-1).type_as(xq)
        out = torch.matmul(probs, values).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(out)


def p_rope_freqs(head_dim: int, base: float = 10000.0, p: float = 0.75) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kept = int(p * inv.numel())
    return torch.cat([inv[:kept], inv.new_zeros(inv.numel() - kept)])


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class PRope(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)
        _trained(self, 33)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        shape = (b, n, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), p_rope_freqs(self.head_dim))
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if self.bug == "kv_swapped":
            k, v = v, k
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class Opposite(TruncatedRope):
    def forward(self, x):
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.h, self.d)
        k = self.c_k(x).view(B, T, self.h, self.d)
        v = self.c_v(x).view(B, T, self.h, self.d)
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        q = self.rotary(q)
        cos, sin = self.cos[None, :T, None, :], self.sin[None, :T, None, :]
        k1, k2 = k.chunk(2, dim=-1)
        k = torch.cat((k1 * cos - k2 * sin, k1 * sin + k2 * cos), 3)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           scale=self.scale)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, self.h * self.d))
