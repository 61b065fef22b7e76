"""RoPE whose frequencies no base gives (docs/trace.md, "How conventions are read"):

- `SpeedrunAttention`: modded-nanogpt's CausalSelfAttention (2025): a weight-free `F.rms_norm` on q and k laid out
  [B, T, H, D], then its half-truncated RoPE: the first quarter of the pairs (i, i + D/2) turn at
  `(1/1024)^linspace(0, 1)`, the rest never (frequency 0), each turned by −θ (`y1 = x1·cos + x2·sin`); SDPA causal
  at a fixed scale. bug="scale_twice" multiplies q by that scale before SDPA scales again.
"""

import torch
import torch.nn.functional as F
from torch import nn


class Rotary(nn.Module):
    def __init__(self, dim, max_seq_len=64):
        super().__init__()
        angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=dim // 4, dtype=torch.float32)
        angular_freq = torch.cat([angular_freq, angular_freq.new_zeros(dim // 4)])
        theta = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), angular_freq)
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x_BTHD):
        cos, sin = self.cos[None, : x_BTHD.size(-3), None, :], self.sin[None, : x_BTHD.size(-3), None, :]
        x1, x2 = x_BTHD.float().chunk(2, dim=-1)
        y1 = x1 * cos + x2 * sin
        y2 = x1 * (-sin) + x2 * cos
        return torch.cat((y1, y2), 3).type_as(x_BTHD)


class SpeedrunAttention(nn.Module):
    def __init__(self, dim=64, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, dim // num_heads, bug
        self.c_q = nn.Linear(dim, dim, bias=False)
        self.c_k = nn.Linear(dim, dim, bias=False)
        self.c_v = nn.Linear(dim, dim, bias=False)
        self.c_proj = nn.Linear(dim, dim, bias=False)
        self.rotary = Rotary(self.head_dim)
        self.attn_scale = 0.12

    def forward(self, x):
        B, T = x.size(0), x.size(1)
        q = self.c_q(x).view(B, T, self.num_heads, self.head_dim)
        k = self.c_k(x).view(B, T, self.num_heads, self.head_dim)
        v = self.c_v(x).view(B, T, self.num_heads, self.head_dim)
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        q, k = self.rotary(q), self.rotary(k)
        if self.bug == "scale_twice":
            q = q * self.attn_scale
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           scale=self.attn_scale)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, self.num_heads * self.head_dim))
