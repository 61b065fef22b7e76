"""Styles that normalize their input inside the attention module before projecting it, written in forms of our own:
lucidrains-like with one fused `to_qkv` after an `nn.LayerNorm`; separate q, k, v Linears after an RMSNorm class of
the file's own; a cross-attention that norms its queries' input and its context apart (`norm_context`). `bug=`
plants a mistake after the norm."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class FusedPreNorm(nn.Module):
    def __init__(self, dim=24, heads=3, bug=None):
        super().__init__()
        self.heads, self.scale, self.bug = heads, (dim // heads) ** -0.5, bug
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        x = self.norm(x)
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        dots = q @ k.transpose(-1, -2) * (1.0 if self.bug == "no_scale" else self.scale)
        attn = dots.softmax(dim=-2 if self.bug == "softmax_dim" else -1)
        return self.to_out((attn @ v).transpose(1, 2).reshape(b, n, -1))


class SeparateRMS(nn.Module):
    def __init__(self, dim=24, heads=3, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.pre = RMSNorm(dim)
        self.wq, self.wk = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.wv, self.wo = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        h = self.pre(x)
        b, n, _ = x.shape
        q = self.wq(h).view(b, n, self.heads, -1).transpose(1, 2)
        k = self.wk(h).view(b, n, self.heads, -1).transpose(1, 2)
        v = (self.wk(h) if self.bug == "values_from_keys" else self.wv(h)).view(b, n, self.heads, -1).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1))


class NormedCross(nn.Module):
    def __init__(self, dim=24, context_dim=16, heads=3, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.norm, self.norm_context = nn.LayerNorm(dim), nn.LayerNorm(context_dim)
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(context_dim, 2 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, context):
        x, context = self.norm(x), self.norm_context(context)
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (t.view(b, t.shape[1], self.heads, -1).transpose(1, 2) for t in self.to_kv(context).chunk(2, dim=-1))
        scores = q @ k.transpose(-1, -2) / (q.shape[-1] if self.bug == "twice" else q.shape[-1] ** 0.5)
        return self.to_out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1))
