"""A diffusion UNet's attention block over [B, C, T], as OpenAI's guided-diffusion writes it: a GroupNorm, a fused
1x1 Conv1d `qkv` split per head ([H, 3, ch], `QKVAttentionLegacy`), ch**-0.25 on q and on k, a 1x1 `proj_out`, the
residual (docs/trace.md, "A pointwise Conv1d is a projection")."""

import math

import torch
from torch import nn


class AttentionBlock(nn.Module):
    def __init__(self, channels=32, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.norm = nn.GroupNorm(8, channels)
        self.qkv = nn.Conv1d(channels, channels * 3, 1)
        self.proj_out = nn.Conv1d(channels, channels, 1)

    def forward(self, x):
        b, c, *spatial = x.shape
        x = x.reshape(b, c, -1)
        qkv = self.qkv(self.norm(x))  # [b, 3·c, T]
        bs, width, length = qkv.shape
        ch = width // (3 * self.num_heads)
        q, k, v = qkv.reshape(bs * self.num_heads, ch * 3, length).split(ch, dim=1)  # [b·H, ch, T] each
        scale = 1 / math.sqrt(math.sqrt(ch))
        weight = torch.einsum("bct,bcs->bts", q * scale, k * scale).softmax(dim=-1)  # [b·H, T, S]
        h = torch.einsum("bts,bcs->bct", weight, v).reshape(bs, -1, length)  # [b, c, T]
        return (x + self.proj_out(h)).reshape(b, c, *spatial)
