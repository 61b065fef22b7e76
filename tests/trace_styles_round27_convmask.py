"""Attention that takes a key-padding mask where trace could not tell which parameter or which operand it was: a fused
1x1 Conv1d making q, k and v over [B, C, W], cut with `chunk(3, dim=1)` (einsum scores `Qᵀ K`) or viewed straight to
[B, 3, H, d, W] and unbound (matmul scores `qᵀ k`), a key-padding mask [B, 1, 1, W] added; and forwards whose
required mask parameter has a name that does not say mask (`keep` read by masked_fill, `valid` only handed to a
helper of this file that reads it as a where's condition, `pad` a 0/1 keep-mask made additive as `(1 - pad) * -1e4`).
Plants: the mask applied on the queries (the fused styles), the mask read the other way round (mask.polarity)."""

import math

import torch
import torch.nn as nn


def _trained(module: nn.Module) -> nn.Module:
    """Weights moved off their initial values (no zero bias, no weight of 1), as a trained model's are."""
    g = torch.Generator().manual_seed(2727)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g) + 0.02)
    return module


class FusedChunkConv(nn.Module):
    """SqueezeBert-like: one fused 1x1 conv cut in three along the channels, heads [B, H, d, W], einsum scores."""

    def __init__(self, channels=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.qkv = nn.Conv1d(channels, 3 * channels, kernel_size=1)
        self.proj = nn.Conv1d(channels, channels, kernel_size=1)
        _trained(self)

    def forward(self, x, attention_mask=None):
        B, C, W = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=1)
        q, k, v = (t.reshape(B, self.heads, C // self.heads, W) for t in (q, k, v))
        scores = torch.einsum("bhdq,bhdk->bhqk", q, k) / math.sqrt(C // self.heads)
        if attention_mask is not None:
            extended = attention_mask.transpose(-1, -2) if self.bug == "mask_on_queries" else attention_mask
            scores = scores + extended
        probs = scores.softmax(dim=-1)
        return self.proj(torch.einsum("bhqk,bhdk->bhdq", probs, v).reshape(B, C, W))


class FusedHeadsConv(nn.Module):
    """One fused 1x1 conv viewed straight to [B, 3, H, d, W] and unbound, matmul scores `qᵀ k` [B, H, W, W], a
    required boolean mask (True = may attend) read by masked_fill."""

    def __init__(self, channels=32, heads=4, bug=None):
        super().__init__()
        self.n_head, self.bug = heads, bug
        self.to_qkv = nn.Conv1d(channels, 3 * channels, 1)
        self.to_out = nn.Conv1d(channels, channels, 1)
        _trained(self)

    def forward(self, hidden, mask):
        b, c, w = hidden.shape
        q, k, v = self.to_qkv(hidden).view(b, 3, self.n_head, c // self.n_head, w).unbind(1)
        attn = (q * (c // self.n_head) ** -0.5).transpose(-2, -1) @ k  # [b, h, w_q, w_k]
        allowed = mask.transpose(-1, -2) if self.bug == "mask_on_queries" else mask
        attn = attn.masked_fill(~allowed.bool(), float("-inf")).softmax(dim=-1)
        out = v @ attn.transpose(-2, -1)  # [b, h, d, w_q]
        return self.to_out(out.reshape(b, c, w))


class KeepRows(nn.Module):
    """Rows [B, n, d], nn.Linear projections, a required `keep` (True = a real token) read by masked_fill."""

    def __init__(self, d_model=32, n_heads=4, bug=None):
        super().__init__()
        self.h, self.bug = n_heads, bug
        self.wq, self.wk = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.wv, self.wo = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        _trained(self)

    def forward(self, x, keep):
        b, n, d = x.shape
        q, k, v = (w(x).view(b, n, self.h, d // self.h).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.h)
        # the keep mask: True = a real token, False = padding
        padded = keep if self.bug == "polarity" else ~keep
        scores = scores.masked_fill(padded, float("-inf"))
        return self.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


def masked_softmax(scores, valid, bug=None):
    """The helper the forward hands its mask to: a where's condition (True = may attend)."""
    allowed = ~valid if bug == "polarity" else valid
    return torch.where(allowed, scores, torch.full_like(scores, float("-inf"))).softmax(dim=-1)


class ValidHelper(nn.Module):
    """Rows, one fused nn.Linear cut in three, a required `valid` the forward only hands to `masked_softmax`."""

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        _trained(self)

    def forward(self, tokens, valid):
        b, n, d = tokens.shape
        q, k, v = self.qkv(tokens).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        weights = masked_softmax(torch.matmul(q, k.transpose(-1, -2)) * (d // self.heads) ** -0.5, valid, self.bug)
        return self.out(torch.matmul(weights, v).transpose(1, 2).flatten(2))


class PadConv(nn.Module):
    """NCW, three 1x1 Conv1d layers, a required `pad` (1.0 = a real token, 0.0 = padding) made additive."""

    def __init__(self, channels=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.q, self.k, self.v = (nn.Conv1d(channels, channels, 1) for _ in range(3))
        _trained(self)

    def forward(self, x, pad):
        B, C, W = x.shape
        d = C // self.heads
        q, k, v = (conv(x).view(B, self.heads, d, W) for conv in (self.q, self.k, self.v))
        scores = torch.matmul(q.transpose(-1, -2), k) / math.sqrt(d)  # [B, H, W_q, W_k]
        # the pad mask: 1 = a real token, 0 = padding
        keep = 1.0 - pad if self.bug == "polarity" else pad
        scores = scores + (1.0 - keep) * -10000.0
        probs = scores.softmax(dim=-1)
        return torch.matmul(v, probs.transpose(-1, -2)).reshape(B, C, W)
