"""Ops of the code's own on its merged heads before the output projection: BitNet's sub-norm, an RMSNorm of the
merged heads (docs/trace.md, "How conventions are read": ops of your own on the merged heads)."""

import torch
from torch import nn


class SubNormAttention(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, scale_twice=False, norm_dropped=False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.scale_twice, self.norm_dropped = scale_twice, norm_dropped
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.sub_norm_weight = nn.Parameter(torch.linspace(0.5, 1.5, hidden_size))

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, self.num_heads, -1).transpose(1, 2)  # [b, h, n, d]
        k = self.k_proj(hidden_states).view(b, n, self.num_heads, -1).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, n, self.num_heads, -1).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) * self.head_dim ** -0.5  # [b, h, n, n]
        if self.scale_twice:
            scores = scores * self.head_dim ** -0.5
        out = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, n, -1)  # [b, n, h·d]
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6) * self.sub_norm_weight  # the sub-norm
        return self.o_proj(out if self.norm_dropped else normed)
