"""Attention that normalizes its rotated q and k and then multiplies them by a learned gain per channel (nGPT's
`sqk · normalize(RoPE(q))`): the gain turns with no rotary pair, so it is not the same as a qk-norm before RoPE. Each
style is its own library's idiom; `bug=` plants a mistake beside the gain. Every module moves its weights off their
initial values, so the gains differ channel by channel and head by head.

- NormalizedBlock: nGPT-like. q, k, v Linear layers, an interleaved RoPE written with strided slices, q and k
  viewed [B, T, H, D], rows of unit length by `x / x.norm(...)`, a gain computed from one parameter
  (`(self.s_qk * (init / scale)).view(1, 1, H, D)`), SDPA with the scale √d_head (the unit rows' convention).
- GainedRmsAfterRope: q and k gains of their own, `[d_head]` each, after `F.rms_norm` of the half-split rotated
  heads [B, H, T, D]; a causal mask filled by hand, softmax, `attn @ v`.
- ComplexRopeUnitRows: one fused qkv, RoPE by complex multiplication (Meta's `view_as_complex`), `F.normalize` of
  the rotated heads, one gain a head shared by q and k (`self.qk_gain` [H, 1, D]), einsum scores scaled by a number
  of the module's (`self.temperature`, a plain float).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return module


def _merge(y, bug):
    """[B, H, T, D] -> [B, T, H·D]; the plant views it straight."""
    b, h, t, d = y.shape
    return y.reshape(b, t, h * d) if bug == "merge_no_transpose" else y.transpose(1, 2).reshape(b, t, h * d)


def _angles(t, d, base=10000.0):
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    return torch.outer(torch.arange(t, dtype=torch.float64), inv)  # [T, D/2]


class NormalizedBlock(nn.Module):
    def __init__(self, n_embd=32, n_head=4, bug=None):
        super().__init__()
        self.n_head, self.d, self.bug = n_head, n_embd // n_head, bug
        self.query = nn.Linear(n_embd, n_embd, bias=False)
        self.key = nn.Linear(n_embd, n_embd, bias=False)
        self.value = nn.Linear(n_embd, n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.s_qk_init, self.s_qk_scale = 1.0, 1.0 / math.sqrt(n_embd)
        self.s_qk = nn.Parameter(self.s_qk_scale * torch.ones(n_embd))
        _trained(self, 1)
        with torch.no_grad():
            self.s_qk.copy_(self.s_qk_scale * (0.6 + torch.rand(n_embd, generator=torch.Generator().manual_seed(2))))

    @staticmethod
    def unit(x):
        return x / x.norm(p=2, dim=-1, keepdim=True)

    def rotate(self, x):  # [B, T, H, D], pairs (2i, 2i + 1)
        a = _angles(x.shape[1], x.shape[-1]).to(x.dtype)[None, :, None, :]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * a.cos() - odd * a.sin(), even * a.sin() + odd * a.cos()), dim=-1).flatten(-2)

    def forward(self, h):
        B, T, C = h.size()
        q = self.query(h).view(B, T, self.n_head, self.d)
        k = self.key(h).view(B, T, self.n_head, self.d)
        v = (self.key(h) if self.bug == "values_from_keys" else self.value(h)).view(B, T, self.n_head, self.d)
        q, k = self.rotate(q), self.rotate(k)
        s_qk = (self.s_qk * (self.s_qk_init / self.s_qk_scale)).view(1, 1, self.n_head, self.d)
        q, k = s_qk * self.unit(q), s_qk * self.unit(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           scale=math.sqrt(self.d))
        return self.c_proj(_merge(y, self.bug))


class GainedRmsAfterRope(nn.Module):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.d, self.bug = heads, dim // heads, bug
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)
        self.q_gain = nn.Parameter(torch.ones(self.d))
        self.k_gain = nn.Parameter(torch.ones(self.d))
        _trained(self, 3)

    def split(self, x):
        return x.view(x.shape[0], x.shape[1], self.heads, self.d).transpose(1, 2)  # [B, H, T, D]

    def rotate(self, x):  # half-split pairs (i, i + D/2)
        a = _angles(x.shape[-2], self.d).to(x.dtype)
        cos, sin = torch.cat((a.cos(), a.cos()), -1), torch.cat((a.sin(), a.sin()), -1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def forward(self, x):
        q, k, v = self.split(self.to_q(x)), self.split(self.to_k(x)), self.split(self.to_v(x))
        q = F.rms_norm(self.rotate(q), (self.d,), eps=1e-6) * self.q_gain
        k = F.rms_norm(self.rotate(k), (self.d,), eps=1e-6) * self.k_gain
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d)  # [B, H, T, T]
        n = x.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = scores.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        return self.to_out(_merge(attn @ v, self.bug))


class ComplexRopeUnitRows(nn.Module):
    def __init__(self, d_model=32, n_heads=4, bug=None):
        super().__init__()
        self.n_heads, self.d, self.bug = n_heads, d_model // n_heads, bug
        self.wqkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)
        self.qk_gain = nn.Parameter(torch.ones(n_heads, 1, self.d))
        self.temperature = 4.0
        _trained(self, 5)
        with torch.no_grad():
            self.qk_gain.mul_(2.0)

    def rotate(self, x):  # [B, H, T, D] as complex pairs (2i, 2i + 1)
        freqs = torch.polar(torch.ones(x.shape[-2], self.d // 2, dtype=torch.float64), _angles(x.shape[-2], self.d))
        turned = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2)) * freqs
        return torch.view_as_real(turned).flatten(-2).to(x.dtype)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.wqkv(x).view(b, n, 3, self.n_heads, self.d).permute(2, 0, 3, 1, 4)  # 3 × [B, H, T, D]
        if self.bug == "kv_swapped":
            k, v = v, k
        q = F.normalize(self.rotate(q), dim=-1) * self.qk_gain
        k = F.normalize(self.rotate(k), dim=-1) * self.qk_gain
        scores = torch.einsum("bhid,bhjd->bhij", q, k) * self.temperature  # [B, H, T, T]
        attn = scores.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        return self.wo(_merge(torch.einsum("bhij,bhjd->bhid", attn, v), self.bug))
