"""RoPE and softmax conventions of round 12's libraries, for tests/test_trace_r12_rope.py; each correct one is checked
there against a float64 formula or F.scaled_dot_product_attention, each planted bug (`bug=`) shown to change the
output.

RoPE turned by −θ (each pair (a, b) to (a·cos + b·sin, −a·sin + b·cos), the transpose of the usual turn: q·k then
depends on j − i, a relative position all the same):
- `MinusHalves`: nanochat's form, `x1 * cos + x2 * sin`, `x1 * (-sin) + x2 * cos` on the halves, its own tables
  [1, T, 1, d_head / 2] as buffers, a weight-free `F.rms_norm` on q and k after RoPE, GQA by SDPA's `enable_gqa`,
  and a decode step whose cache is a `(k, v)` tuple joined after RoPE; bugs `tiled` (the kv heads by `.repeat`:
  gqa.tiled), `new_first` (cache.order), `no_offset` (the new positions from 0: rope.positions), `is_causal`
  (SDPA's is_causal=True in a chunk decode: mask.upper_left);
- `ConjComplex`: Meta's complex form with the table conjugated, `view_as_complex(x) * freqs_cis.conj()`
  (interleaved pairs), matmul scores and a causal mask; bugs `no_scale` (scale.none), `kv_swapped`;
- `MinusRotateHalf`: transformers' `rotate_half` with the sign moved, `x * cos - rotate_half(x) * sin`, full-width
  `cat(freqs, freqs)` tables, folded heads and `baddbmm`; bug `q_only` (only q turned by −θ, k by +θ: no
  relative position, never a convention).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _angles(n, d, base=10000.0):  # [n, d / 2]
    return torch.arange(n, dtype=torch.float32)[:, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)


# --- RoPE by −θ -----------------------------------------------------------------------------------------------


def _minus_halves(x, cos, sin):
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], -1)


class MinusHalves(nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=2, bug=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.bug = heads, kv_heads, dim // heads, bug
        self.c_q = nn.Linear(dim, dim, bias=False)
        self.c_k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.c_v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.c_proj = nn.Linear(dim, dim, bias=False)
        angles = _angles(64, self.head_dim)
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)

    def forward(self, x, kv_cache=None):
        B, T, _ = x.shape
        T0 = 0 if kv_cache is None or self.bug == "no_offset" else kv_cache[0].size(2)
        cos, sin = self.cos[:, T0:T0 + T], self.sin[:, T0:T0 + T]
        q = self.c_q(x).view(B, T, self.heads, self.head_dim)
        k = self.c_k(x).view(B, T, self.kv_heads, self.head_dim)
        v = self.c_v(x).view(B, T, self.kv_heads, self.head_dim)
        q, k = _minus_halves(q, cos, sin), _minus_halves(k, cos, sin)
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv_cache is not None:
            first = (k, kv_cache[0]) if self.bug == "new_first" else (kv_cache[0], k)
            k = torch.cat(first, dim=2)
            v = torch.cat((v, kv_cache[1]) if self.bug == "new_first" else (kv_cache[1], v), dim=2)
        gqa = True
        if self.bug == "tiled":
            k, v = k.repeat(1, self.heads // self.kv_heads, 1, 1), v.repeat(1, self.heads // self.kv_heads, 1, 1)
            gqa = False
        Tq, Tk = q.size(2), k.size(2)
        if Tq == Tk or self.bug == "is_causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            keep = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=gqa)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class ConjComplex(nn.Module):
    def __init__(self, dim=24, n_heads=3, bug=None):
        super().__init__()
        self.n_heads, self.head_dim, self.bug = n_heads, dim // n_heads, bug
        self.wq, self.wk = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.wv, self.wo = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.register_buffer("freqs_cis", torch.polar(torch.ones(64, self.head_dim // 2), _angles(64, self.head_dim)),
                             persistent=False)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = (w(x).view(bsz, seqlen, self.n_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        turn = self.freqs_cis[:seqlen].conj()[None, :, None, :]
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        xq = torch.view_as_real(xq_ * turn).flatten(3).type_as(xq)
        xk = torch.view_as_real(xk_ * turn).flatten(3).type_as(xk)
        if self.bug == "kv_swapped":
            xk, xv = xv, xk
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = q @ k.transpose(2, 3)
        if self.bug != "no_scale":
            scores = scores / math.sqrt(self.head_dim)
        mask = torch.full((seqlen, seqlen), float("-inf")).triu(1)
        out = F.softmax(scores + mask, dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class MinusRotateHalf(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        self.query = nn.Linear(embed_dim, embed_dim)
        self.key = nn.Linear(embed_dim, embed_dim)
        self.value = nn.Linear(embed_dim, embed_dim)
        self.dense = nn.Linear(embed_dim, embed_dim)
        angles = _angles(64, self.head_dim)
        emb = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        cos, sin = self.cos_cached[:n], self.sin_cached[:n]

        def fold(t):  # [b, n, h·d] -> [b·h, n, d]
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2).reshape(b * self.num_heads, n, -1)

        q, k, v = fold(self.query(hidden_states)), fold(self.key(hidden_states)), fold(self.value(hidden_states))
        q = q * cos - _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin if self.bug == "q_only" else k * cos - _rotate_half(k) * sin
        bias = torch.zeros(n, n, dtype=q.dtype).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        scores = torch.baddbmm(bias.expand(b * self.num_heads, n, n), q, k.transpose(1, 2), alpha=self.head_dim ** -0.5)
        out = torch.bmm(scores.softmax(-1), v).view(b, self.num_heads, n, -1).transpose(1, 2).reshape(b, n, -1)
        return self.dense(out)
