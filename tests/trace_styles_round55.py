"""Styles for tests/test_trace_round55.py, written afresh.

UnfoldedPixels: MobileViT's global representation (apple/ml-cvnets' MobileViTBlock) on a feature map
`[B, C, H, W]`: the map cut into 2×2 patches by F.unfold, the tokens at one pixel position of every patch moved into
the batch axis (`[B·P, N, C]`), multi-head attention over them with one fused qkv Linear, and F.fold back.
bug='kv_swapped' takes the keys from the values' third of qkv and the values from the keys'."""

import torch
import torch.nn.functional as F
from torch import nn


class UnfoldedPixels(nn.Module):
    def __init__(self, channels=16, heads=2, patch=2, bug=None):
        super().__init__()
        self.heads, self.patch, self.bug = heads, patch, bug
        self.qkv_proj = nn.Linear(channels, 3 * channels)
        self.out_proj = nn.Linear(channels, channels)

    def attention(self, x):
        b, n, c = x.shape
        qkv = self.qkv_proj(x).reshape(b, n, 3, self.heads, -1).transpose(1, 3).contiguous()  # [b, h, 3, n, d]
        query, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.bug == "kv_swapped":
            key, value = value, key
        query = query * (c // self.heads) ** -0.5
        attn = torch.matmul(query, key.transpose(-1, -2)).softmax(dim=-1)
        out = torch.matmul(attn, value).transpose(1, 2).reshape(b, n, c)
        return self.out_proj(out)

    def forward(self, feature_map):
        B, C, H, W = feature_map.shape
        p = self.patch
        patches = F.unfold(feature_map, kernel_size=p, stride=p)  # [B, C·P, N]
        N = patches.shape[-1]
        patches = patches.reshape(B, C, p * p, N).permute(0, 2, 3, 1).reshape(B * p * p, N, C)
        patches = self.attention(patches)
        patches = patches.reshape(B, p * p, N, C).permute(0, 3, 1, 2).reshape(B, C * p * p, N)
        return F.fold(patches, output_size=(H, W), kernel_size=p, stride=p)
