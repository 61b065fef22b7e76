"""Round 24's queries' and keys' input made from the module's input before their projections, the values' projection
reading the input as it is: rotary position on the hidden states themselves (a Wav2Vec2-Conformer-like block, its
table held as buffers; a functional one on parameters with F.linear, its rotation by complex numbers), a learned
per-position affine of the input (scale and shift per position, read by q and k alone), and DETR's `q = k = src +
pos` with a learned position Parameter. Plants: the scale by d_head, none, the softmax over the queries, dropout left
on, the heads merged without their transpose."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def _trained(module: nn.Module) -> nn.Module:
    """Weights moved off their initial values, as a trained model's are."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g) + 0.01)
    return module


def _attend(q, k, v, heads, bug, p=0.1):
    """[B, N, D] each: multi-head attention with the round's plants, the heads merged back to [B, N, D]."""
    B, N, D = q.shape
    q, k, v = (t.reshape(B, N, heads, -1).transpose(1, 2) for t in (q, k, v))
    d = D // heads
    s = q @ k.transpose(-1, -2)
    s = s / d if bug == "scale_d_head" else s if bug == "no_scale" else s / math.sqrt(d)
    a = s.softmax(dim=-2 if bug == "softmax_axis" else -1)
    a = F.dropout(a, p=p) if bug == "dropout_on" else a
    o = a @ v
    return o.reshape(B, N, D) if bug == "merge_no_transpose" else o.transpose(1, 2).reshape(B, N, D)


class RotatedStates(nn.Module):
    """A Conformer-like block: the hidden states viewed as heads and rotated by position (rotate-half, the table as
    buffers), then `q_lin(rotated)`, `k_lin(rotated)`, `v_lin(hidden)`."""

    def __init__(self, d_model=16, n_heads=2, max_len=32, bug=None):
        super().__init__()
        self.h, self.bug = n_heads, bug
        d = d_model // n_heads
        inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
        ang = torch.outer(torch.arange(max_len).float(), inv)
        self.register_buffer("cos_t", torch.cat([ang, ang], -1).cos())
        self.register_buffer("sin_t", torch.cat([ang, ang], -1).sin())
        self.q_lin, self.k_lin, self.v_lin, self.out_lin = (nn.Linear(d_model, d_model) for _ in range(4))
        _trained(self)

    def rotate(self, x):
        B, N, D = x.shape
        x = x.view(B, N, self.h, -1)
        half = x.shape[-1] // 2
        turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        cos, sin = self.cos_t[:N, None, :], self.sin_t[:N, None, :]
        return (x * cos + turned * sin).reshape(B, N, D)

    def forward(self, hidden):
        qk = self.rotate(hidden)
        o = _attend(self.q_lin(qk), self.k_lin(qk), self.v_lin(hidden), self.h, self.bug)
        return self.out_lin(o)


class ComplexRotated(nn.Module):
    """Functional: weights as Parameters through F.linear, the input turned by complex numbers (Meta's
    view_as_complex idiom, pairs of adjacent features) before the queries' and keys' projections."""

    def __init__(self, dim=16, heads=2, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.wq, self.wk, self.wv, self.wo = (nn.Parameter(torch.randn(dim, dim) / math.sqrt(dim)) for _ in range(4))
        self.bq, self.bk, self.bv, self.bo = (nn.Parameter(torch.zeros(dim)) for _ in range(4))
        _trained(self)

    def forward(self, x):
        B, N, D = x.shape
        d = D // self.heads
        freqs = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        cis = torch.polar(torch.ones(N, d // 2), torch.outer(torch.arange(N, dtype=torch.float32), freqs))
        xc = torch.view_as_complex(x.float().reshape(B, N, self.heads, d // 2, 2))
        xr = torch.view_as_real(xc * cis[:, None, :]).flatten(2).type_as(x)
        q, k, v = F.linear(xr, self.wq, self.bq), F.linear(xr, self.wk, self.bk), F.linear(x, self.wv, self.bv)
        return F.linear(_attend(q, k, v, self.heads, self.bug), self.wo, self.bo)


class PositionAffine(nn.Module):
    """A learned per-position scale and shift of the input (a position embedding that also gates), read by the
    queries' and keys' projections alone; the values read the input."""

    def __init__(self, d_model=16, nhead=2, max_len=32, bug=None):
        super().__init__()
        self.nhead, self.bug = nhead, bug
        self.pos_gain = nn.Parameter(1.0 + 0.3 * torch.randn(max_len, d_model))
        self.pos_shift = nn.Parameter(0.3 * torch.randn(max_len, d_model))
        self.to_q, self.to_k, self.to_v, self.proj = (nn.Linear(d_model, d_model) for _ in range(4))
        _trained(self)

    def forward(self, src):
        n = src.shape[1]
        qk_in = src * self.pos_gain[:n] + self.pos_shift[:n]
        o = _attend(self.to_q(qk_in), self.to_k(qk_in), self.to_v(src), self.nhead, self.bug)
        return self.proj(o)


class DetrEncoderLayer(nn.Module):
    """DETR's encoder self-attention: `q = k = src + pos` (a learned position Parameter), `v = src`."""

    def __init__(self, d_model=16, nhead=2, max_len=32, bug=None):
        super().__init__()
        self.nhead, self.bug = nhead, bug
        self.query_pos = nn.Parameter(0.5 * torch.randn(max_len, d_model))
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d_model, d_model) for _ in range(4))
        _trained(self)

    def forward(self, src):
        q = k = src + self.query_pos[: src.shape[1]]
        o = _attend(self.q_proj(q), self.k_proj(k), self.v_proj(src), self.nhead, self.bug)
        return self.out_proj(o)
