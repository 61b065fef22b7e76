"""RoPE whose angles are no one position times a frequency, and RoPE scaled (docs/trace.md, "How conventions are
read"):

- `AxialAttention`: a ViT block's attention with EVA-02-style 2-D RoPE: a cls token kept aside, unrotated, then a
  3 x 3 patch grid whose row turns the first half of each head's pairs and whose column turns the second half,
  pairs interleaved (rotate_every_two), one cos/sin table over the grid; a fused qkv. bug="rope_on_v" rotates the
  values as well; bug="softmax_axis" takes the softmax over the queries.
- `LinearScaledAttention`: transformers' LLaMA with linear RoPE scaling (`rope_scaling={"type": "linear",
  "factor": 2.0}`: positions t / 2, position interpolation), rotate_half, causal.
"""

import torch
import torch.nn.functional as F
from torch import nn


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _moved(module):
    """Weights moved off their init, as a checkpoint's are."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return module


class AxialAttention(nn.Module):
    def __init__(self, dim=32, num_heads=2, grid=3, theta=10000.0, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        half = head_dim // 2  # the row's pairs, then the column's
        freqs = 1.0 / theta ** (torch.arange(0, half, 2).float() / half)
        f = torch.outer(torch.arange(grid).float(), freqs).repeat_interleave(2, dim=-1)  # [grid, half]
        table = torch.cat((f[:, None].expand(grid, grid, half), f[None, :].expand(grid, grid, half)), -1)
        self.register_buffer("freqs_cos", table.reshape(grid * grid, head_dim).cos())
        self.register_buffer("freqs_sin", table.reshape(grid * grid, head_dim).sin())
        _moved(self)

    def rope(self, t):
        return t * self.freqs_cos + rotate_every_two(t) * self.freqs_sin

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q = torch.cat((q[:, :, :1], self.rope(q[:, :, 1:])), dim=-2)  # the cls token stays as it is
        k = torch.cat((k[:, :, :1], self.rope(k[:, :, 1:])), dim=-2)
        if self.bug == "rope_on_v":
            v = torch.cat((v[:, :, :1], self.rope(v[:, :, 1:])), dim=-2)
        attn = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        attn = attn.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class LinearScaledAttention(nn.Module):
    def __init__(self, hidden_size=32, num_heads=2, rope_theta=10000.0, factor=2.0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.rope_scaling = {"type": "linear", "factor": factor}
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        _moved(self)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        t = torch.arange(n, dtype=self.inv_freq.dtype) / self.rope_scaling["factor"]
        emb = torch.outer(t, self.inv_freq).repeat(1, 2)
        cos, sin = emb.cos(), emb.sin()
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))
