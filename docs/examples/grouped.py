"""Attention within groups of tokens the module makes itself (docs/trace.md, "Attention within groups the module
makes"): Swin's window partition inside the module, on a 4×4 grid of tokens in raster order (`bug='scale'` scales
the scores twice); Hiera's mask units, q, k and v cut into groups after the projection (MaskUnits, with --nq 12):

    attnscope trace docs/examples/grouped.py:WindowAttention --nq 16
    attnscope trace docs/examples/grouped.py:WindowAttention --init "bug='scale'" --nq 16
"""

import torch.nn as nn


class WindowAttention(nn.Module):
    def __init__(self, dim=32, num_heads=4, grid=4, window=2, bug=None):
        super().__init__()
        self.num_heads, self.grid, self.window, self.bug = num_heads, grid, window, bug
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, L, C = x.shape
        g, w = self.grid // self.window, self.window
        # [B, H·W, C] -> [B·g·g, w·w, C]: each window a sequence of its own
        windows = x.view(B, g, w, g, w, C).permute(0, 1, 3, 2, 4, 5).reshape(B * g * g, w * w, C)
        b, n, _ = windows.shape
        q, k, v = self.qkv(windows).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        if self.bug == "scale":
            attn = attn * self.scale
        out = self.proj((attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, n, C))
        # the windows put back: [B·g·g, w·w, C] -> [B, H·W, C]
        return out.view(B, g, g, w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(B, L, C)


class MaskUnits(nn.Module):
    """Hiera's mask unit attention: q, k and v cut into `units` groups after the fused projection, an axis of their
    own beside the heads, token t in unit t % units."""

    def __init__(self, dim=32, heads=4, units=3):
        super().__init__()
        self.heads, self.units = heads, units
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, -1, self.units, 3, self.heads, C // self.heads).permute(3, 0, 4, 2, 1, 5) \
            .unbind(0)  # [B, heads, units, N / units, d] each
        attn = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
        x = attn.softmax(dim=-1) @ v
        return self.proj(x.transpose(1, 3).reshape(B, -1, C))


class PooledUnits(nn.Module):
    """Hiera's mask unit attention at a stage transition: each unit's queries max-pooled over `q_stride` inside it,
    its keys and values not, so a unit's few queries meet its own tokens alone; the width grows (dim -> dim_out)."""

    def __init__(self, dim=16, dim_out=32, heads=4, units=5, q_stride=2, bug=None):
        super().__init__()
        self.heads, self.units, self.q_stride, self.dim_out, self.bug = heads, units, q_stride, dim_out, bug
        self.qkv = nn.Linear(dim, 3 * dim_out)
        self.proj = nn.Linear(dim_out, dim_out)

    def forward(self, x):
        B, N, _ = x.shape
        d = self.dim_out // self.heads
        q, k, v = self.qkv(x).reshape(B, -1, self.units, 3, self.heads, d).permute(3, 0, 4, 2, 1, 5).unbind(0)
        if self.bug == "shifted":  # each unit's queries against the next unit's keys and values
            k, v = k.roll(1, dims=2), v.roll(1, dims=2)
        q = q.view(B, self.heads, self.units, self.q_stride, -1, d).max(dim=3).values  # [B, heads, units, n / 2, d]
        attn = (q * d ** -0.5) @ k.transpose(-1, -2)
        x = attn.softmax(dim=-1) @ v
        return self.proj(x.transpose(1, 3).reshape(B, -1, self.dim_out))
