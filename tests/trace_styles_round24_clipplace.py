"""Round 24's clip_qkv in its two places: after the projections (DBRX, OLMo: the fused output clamped before the
split and the qk-norm) or after the qk-norm (HF OLMoE: `q_norm(q_proj(x)).clamp_(...)`, v after its projection). The
bound is each module's `clip_qkv` (a config object, a dict, an attribute).

- `OlmoeLike`: separate projections, an RMSNorm over each whole projection, then q, k and v clamped in place; GQA,
  RoPE from its own positions, an additive causal mask.
- `DbrxLike`: a fused Wqkv clamped, then split [q | k | v] (GQA), no qk-norm, SDPA causal.
- `OlmoLike`: a fused att_proj clamped in place, chunked, then q and k normed over the whole projection (a
  LayerNorm without bias written out), RoPE, causal SDPA.
- `HeadNormClip`: q and k normed per head (Qwen3's RMSNorm over d_head), then clamped; RoPE after.
Plants: `k_unclipped` (OlmoeLike's k never clamped), `after_rope` (OlmoeLike's q and k clamped after RoPE),
`half_clip` (DbrxLike's bound halved), `no_scale` (OlmoLike's scores unscaled: scale.none), `swap_kv` (HeadNormClip's
keys and values swapped: kv.swapped).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module: nn.Module, seed: int) -> None:
    """Weights moved off their initial values, biases not zero, norm gains off 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() == 1 else 0.05))


def _half_turn(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-split RoPE at positions 0..n-1, base 10000, cos and sin in float32."""
    n, d = q.shape[-2], q.shape[-1]
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    return q * cos + _half_turn(q) * sin, k * cos + _half_turn(k) * sin


class Rms(nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class OlmoeLike(nn.Module):
    def __init__(self, config=None, bug=None):
        super().__init__()
        self.config = config or SimpleNamespace(hidden_size=32, num_heads=4, num_kv_heads=2, clip_qkv=0.6)
        c, self.bug = self.config, bug
        self.h, self.kv, self.d = c.num_heads, c.num_kv_heads, c.hidden_size // c.num_heads
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv * self.d, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, c.hidden_size, bias=False)
        self.q_norm, self.k_norm = Rms(self.h * self.d), Rms(self.kv * self.d)
        _trained(self, 21)

    def forward(self, hidden_states, attention_mask=None):
        b, n, _ = hidden_states.shape
        c = self.config.clip_qkv
        q, k = self.q_norm(self.q_proj(hidden_states)), self.k_norm(self.k_proj(hidden_states))
        v = self.v_proj(hidden_states)
        clamped = {"k_unclipped": (q, v), "after_rope": (v,)}.get(self.bug, (q, k, v))
        for t in clamped:
            t.clamp_(min=-c, max=c)
        q = q.view(b, n, self.h, self.d).transpose(1, 2)
        k = k.view(b, n, self.kv, self.d).transpose(1, 2)
        v = v.view(b, n, self.kv, self.d).transpose(1, 2)
        q, k = rope(q, k)
        if self.bug == "after_rope":
            q, k = q.clamp(-c, c), k.clamp(-c, c)
        k, v = (t[:, :, None].expand(b, self.kv, self.h // self.kv, n, self.d).reshape(b, self.h, n, self.d)
                for t in (k, v))
        w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.d)
        if attention_mask is not None:
            w = w + attention_mask
        out = torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class DbrxLike(nn.Module):
    def __init__(self, d_model=32, n_heads=4, kv_n_heads=2, clip_qkv=0.7, bug=None):
        super().__init__()
        self.d_model, self.n_heads, self.kv_n_heads, self.clip_qkv, self.bug = d_model, n_heads, kv_n_heads, \
            clip_qkv, bug
        self.head_dim = d_model // n_heads
        self.Wqkv = nn.Linear(d_model, d_model + 2 * kv_n_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        _trained(self, 22)

    def forward(self, x):
        b, n, _ = x.shape
        bound = self.clip_qkv / (2 if self.bug == "half_clip" else 1)
        qkv = self.Wqkv(x).clamp(min=-bound, max=bound)
        kv_width = self.kv_n_heads * self.head_dim
        q, k, v = qkv.split([self.d_model, kv_width, kv_width], dim=2)
        q = q.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, n, self.kv_n_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, n, self.kv_n_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, self.d_model))


class OlmoLike(nn.Module):
    def __init__(self, config=None, bug=None):
        super().__init__()
        self.config = config or {"d_model": 24, "n_heads": 3, "clip_qkv": 0.9}
        d, self.bug = self.config["d_model"], bug
        self.att_proj = nn.Linear(d, 3 * d)
        self.attn_out = nn.Linear(d, d)
        self.q_norm_weight = nn.Parameter(torch.ones(d))
        self.k_norm_weight = nn.Parameter(torch.ones(d))
        _trained(self, 23)

    def _norm(self, x, weight):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5) * weight

    def forward(self, x):
        b, n, d = x.shape
        h = self.config["n_heads"]
        qkv = self.att_proj(x)
        qkv.clamp_(min=-self.config["clip_qkv"], max=self.config["clip_qkv"])
        q, k, v = qkv.chunk(3, dim=-1)
        q, k = self._norm(q, self.q_norm_weight), self._norm(k, self.k_norm_weight)
        q, k, v = (t.view(b, n, h, d // h).transpose(1, 2) for t in (q, k, v))
        q, k = rope(q, k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 if self.bug == "no_scale" else None)
        return self.attn_out(out.transpose(1, 2).reshape(b, n, d))


class HeadNormClip(nn.Module):
    def __init__(self, dim=32, heads=4, clip_qkv=0.5, bug=None):
        super().__init__()
        self.heads, self.d, self.clip_qkv, self.bug = heads, dim // heads, clip_qkv, bug
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.o_proj = nn.Linear(dim, dim)
        self.q_norm, self.k_norm = Rms(self.d), Rms(self.d)
        _trained(self, 24)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.heads, self.d) for p in (self.q_proj, self.k_proj, self.v_proj))
        c = self.clip_qkv
        q, k = self.q_norm(q).clamp(-c, c), self.k_norm(k).clamp(-c, c)
        v = v.clamp(-c, c)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = rope(q, k)
        if self.bug == "swap_kv":
            k, v = v, k
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))
