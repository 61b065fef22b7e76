"""A local attention block that takes its tokens' positions as a required argument, one row for each sequence, and
asserts their shape before any use (recurrentgemma's `LocalAttentionBlock.forward(x, segment_pos)`): docs/trace.md
("A parameter read from its use").

    attnscope trace docs/examples/row_positions.py:LocalBlock --rope --window 3
    attnscope trace docs/examples/row_positions.py:LocalBlock --init "bug='window_off'" --rope --window 3   # exit 1

RoPE half-split from `positions[..., None] * inv_freq`, a causal band of `window` keys made by comparing the
positions, one key and value head (multi-query). Weights moved off their initial values."""

import torch
from torch import nn


class LocalBlock(nn.Module):
    def __init__(self, width=32, num_heads=4, window=3, bug=None):
        super().__init__()
        self.h, self.d, self.window, self.bug = num_heads, width // num_heads, window, bug
        self.proj_q = nn.Linear(width, width, bias=False)
        self.proj_k = nn.Linear(width, self.d, bias=False)  # one head's keys and values, shared
        self.proj_v = nn.Linear(width, self.d, bias=False)
        self.proj_final = nn.Linear(width, width, bias=True)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in self.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)

    def rope(self, t, positions):
        inv = 1.0 / 10000.0 ** (torch.arange(0, self.d, 2) / self.d)
        angles = positions[:, :, None, None] * inv  # [b, t, 1, d/2]
        first, second = t.chunk(2, dim=-1)
        return torch.cat([first * angles.cos() - second * angles.sin(),
                          second * angles.cos() + first * angles.sin()], dim=-1)

    def forward(self, x, segment_pos):
        b, t, _ = x.shape
        assert segment_pos.shape == (b, t), segment_pos.shape
        q = self.rope(self.proj_q(x).reshape(b, t, self.h, self.d), segment_pos)  # [b, t, h, d]
        k = self.rope(self.proj_k(x).reshape(b, t, 1, self.d), segment_pos)  # [b, t, 1, d]
        v = self.proj_v(x).reshape(b, t, 1, self.d)
        near = segment_pos[:, :, None] - segment_pos[:, None, :]  # [b, t, t]
        band = near <= self.window if self.bug == "window_off" else near < self.window
        seen = (near >= 0) & band
        logits = torch.einsum("btnh,bsnh->bnts", q, k) * self.d ** -0.5  # [b, h, t, t]
        probs = logits.masked_fill(~seen[:, None], float("-inf")).softmax(dim=-1)
        encoded = torch.einsum("bnts,bsnh->btnh", probs, v).reshape(b, t, -1)  # [b, t, h·d]
        return self.proj_final(encoded)
