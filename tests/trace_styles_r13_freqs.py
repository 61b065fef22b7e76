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


# --- a fused projection's output reshaped straight to heads, then split ---------------------------------------
# - `ElmSplit`: OpenELM's qkv_proj [b, s, (q + 2k)·d] reshaped [b, s, q + 2k, d], transposed, split by head counts,
#   q/k RMSNorm with weights, RoPE (rotate_half), repeat_interleave, SDPA causal; bug "straight" reshapes to
#   [b, q + 2k, s, d] with no transpose.
# - `GptFused`: nanoGPT-like c_attn [b, s, 3·d] viewed [b, s, 3h, d], transposed, chunk(3, dim=1); bug "straight".
# - `TimmNormed`: timm's Attention with qk_norm=True (nn.LayerNorm(head_dim)): qkv.reshape(B, N, 3, H, D)
#   .permute(2, 0, 3, 1, 4).unbind(0); bug "straight" reshapes to (B, 3, H, N, D) and unbinds axis 1.


class HeadRms(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class ElmSplit(nn.Module):
    def __init__(self, model_dim=32, head_dim=8, q_heads=4, kv_heads=2, bug=None):
        super().__init__()
        self.d, self.hq, self.hk, self.bug = head_dim, q_heads, kv_heads, bug
        self.qkv_proj = nn.Linear(model_dim, (q_heads + 2 * kv_heads) * head_dim, bias=False)
        self.q_norm, self.k_norm = HeadRms(head_dim), HeadRms(head_dim)
        self.out_proj = nn.Linear(q_heads * head_dim, model_dim, bias=False)
        _trained(self, 34)

    def forward(self, hidden_states):
        b, s, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        if self.bug == "straight":
            qkv = qkv.reshape(b, self.hq + 2 * self.hk, s, self.d)
        else:
            qkv = qkv.reshape(b, s, self.hq + 2 * self.hk, self.d).transpose(1, 2)
        queries, keys, values = qkv.split([self.hq, self.hk, self.hk], dim=1)
        queries, keys = self.q_norm(queries), self.k_norm(keys)
        inv = 1.0 / (10000 ** (torch.arange(0, self.d, 2, dtype=torch.float32) / self.d))
        emb = torch.outer(torch.arange(s, dtype=torch.float32), inv)
        emb = torch.cat((emb, emb), -1)
        queries = queries * emb.cos() + _rotate_half(queries) * emb.sin()
        keys = keys * emb.cos() + _rotate_half(keys) * emb.sin()
        keys = keys.repeat_interleave(self.hq // self.hk, dim=1)
        values = values.repeat_interleave(self.hq // self.hk, dim=1)
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, self.hq * self.d))


class GptFused(nn.Module):
    def __init__(self, n_embd=32, n_head=4, bug=None):
        super().__init__()
        self.n_head, self.bug = n_head, bug
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        _trained(self, 35)

    def forward(self, x):
        B, T, C = x.size()
        qkv = self.c_attn(x)
        if self.bug == "straight":
            qkv = qkv.view(B, 3 * self.n_head, T, C // self.n_head)
        else:
            qkv = qkv.view(B, T, 3 * self.n_head, C // self.n_head).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=1)
        att = F.softmax((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1))), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class TimmNormed(nn.Module):
    def __init__(self, dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, dim // num_heads, bug
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.q_norm, self.k_norm = nn.LayerNorm(self.head_dim), nn.LayerNorm(self.head_dim)
        self.proj = nn.Linear(dim, dim)
        _trained(self, 36)

    def forward(self, x):
        B, N, C = x.shape
        if self.bug == "straight":
            q, k, v = self.qkv(x).reshape(B, 3, self.num_heads, N, self.head_dim).unbind(1)
        else:
            q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


# --- heads merged after another permute than (0, 2, 1, 3) -------------------------------------------------------
# - `VitMerge`: vit-pytorch's Attention (to_qkv chunk(3), matmul · scale, nn.Softmax, to_out); bug "d_h" merges
#   as einops' 'b h n d -> b n (d h)' (permute(0, 2, 3, 1)).
# - `SdpaMerge`: separate projections, SDPA; bug "swap_last" merges x.transpose(-1, -2).reshape(b, n, -1).
# - `EinsumMerge`: einsum scores and output; bug "d_h" merges with einsum('bhnd->bndh').


class VitMerge(nn.Module):
    def __init__(self, dim=32, heads=4, dim_head=8, bug=None):
        super().__init__()
        self.heads, self.scale, self.bug = heads, dim_head ** -0.5, bug
        self.attend = nn.Softmax(dim=-1)
        self.to_qkv = nn.Linear(dim, heads * dim_head * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(heads * dim_head, dim), nn.Dropout(0.0))
        _trained(self, 37)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for t in self.to_qkv(x).chunk(3, dim=-1))
        attn = self.attend(torch.matmul(q, k.transpose(-1, -2)) * self.scale)
        out = torch.matmul(attn, v)
        out = out.permute(0, 2, 3, 1) if self.bug == "d_h" else out.permute(0, 2, 1, 3)
        return self.to_out(out.reshape(b, n, -1))


class SdpaMerge(nn.Module):
    def __init__(self, d_model=32, n_head=4, bug=None):
        super().__init__()
        self.n_head, self.bug = n_head, bug
        self.q_proj, self.k_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.v_proj, self.out_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        _trained(self, 38)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (p(x).view(b, n, self.n_head, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(-1, -2) if self.bug == "swap_last" else y.transpose(1, 2)
        return self.out_proj(y.reshape(b, n, d))


class EinsumMerge(nn.Module):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.h, self.bug = heads, bug
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)
        _trained(self, 39)

    def forward(self, x):
        b, n, dim = x.shape
        q, k, v = (w(x).view(b, n, self.h, dim // self.h) for w in (self.wq, self.wk, self.wv))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dim // self.h)
        out = torch.einsum("bhqk,bkhd->bhqd", scores.softmax(-1), v)
        out = torch.einsum("bhqd->bqdh", out) if self.bug == "d_h" else torch.einsum("bhqd->bqhd", out)
        return self.wo(out.reshape(b, n, dim))
