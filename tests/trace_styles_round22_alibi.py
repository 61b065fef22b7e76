"""Styles of our own for tests/test_trace_round22_alibi.py: ALiBi written as −m_h·|j − i| (symmetric, equal to ALiBi's
m_h·(j − i) on the cells a causal mask keeps) with a causal mask applied before the bias (round 22's Jais). A plant
in the mask then makes two deviations at once (the future cells let through carry −m|j − i|, not ALiBi's bias), which
no one catalog entry reproduces: the message must say so, never that the code adds no bias. Weights moved off their
initial values.

- AbsAlibi: fused qkv, `torch.where(causal, scores, finfo.min)`, then `+ (−m · |j − i|)`. `bug`: 'band_off' (the
  causal band one key too wide), 'mask_after_softmax' (the mask applied to the weights, after the softmax), 'no_bias'
  (no bias at all: that one is said missing).
"""

from __future__ import annotations

import torch
from torch import nn


def trained(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


class AbsAlibi(nn.Module):
    def __init__(self, dim=32, heads=4, bug=""):
        super().__init__()
        self.h, self.d, self.bug = heads, dim // heads, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("slopes", torch.tensor([2.0 ** (-8 * (i + 1) / heads) for i in range(heads)]))
        trained(self, 24)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.d).permute(2, 0, 3, 1, 4)  # [B, h, n, d] each
        att = q @ k.transpose(-2, -1) / self.d ** 0.5  # [B, h, n, n]
        pos = torch.arange(n)
        keep = (pos[None, :] <= pos[:, None] + (1 if self.bug == "band_off" else 0))  # [n, n]
        if self.bug != "mask_after_softmax":
            att = torch.where(keep, att, torch.finfo(att.dtype).min)
        if self.bug != "no_bias":
            att = att + -self.slopes[:, None, None] * (pos[None, :] - pos[:, None]).abs()  # −m_h·|j − i|
        att = att.softmax(-1)
        if self.bug == "mask_after_softmax":
            att = torch.where(keep, att, 0.0)
        return self.proj((att @ v).transpose(1, 2).reshape(b, n, c))
