"""Attention whose queries and keys are changed before the scores, but not by one table of angles a RoPE trace
reads: V-JEPA 2's 3-D rotary, written here in a style of its own. Each head's coordinates are cut in three chunks
turned by a token's frame, row and column on a 2 x 2 grid, the last coordinates left as they are; within a chunk the
sines and cosines are laid out for half-split pairs ([f0 .. f_{c/2-1}, f0 .. f_{c/2-1}]) while the coordinates are
paired (2i, 2i + 1), so a pair's two coordinates turn by different angles (as rotate_queries_or_keys lays them).
NotTurned is the same attention with no rotation at all."""

from __future__ import annotations

import torch
from torch import nn


def _skewed(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / 10000 ** (torch.arange(d // 2, dtype=x.dtype) / (d / 2))
    angle = pos.to(x.dtype)[:, None] * inv  # [n, d/2]
    sin, cos = angle.sin().repeat(1, 2), angle.cos().repeat(1, 2)  # half-split layout of the angles
    pairs = x.unflatten(-1, (-1, 2))
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)  # interleaved partner
    return x * cos + turned * sin


class SkewedRotary(nn.Module):
    def __init__(self, width: int = 56, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_width = heads, width // heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)
        with torch.no_grad():
            for p in self.parameters():
                p.add_(0.05 * torch.randn_like(p))

    def turn(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(x.shape[-2])
        frame, row, col = ids // 4, (ids % 4) // 2, ids % 2  # a 2 x 2 grid of tokens per frame
        c = 2 * ((self.head_width // 3) // 2)  # 4 of a head's 14 coordinates per axis, 2 left unturned
        chunks = [_skewed(x[..., i * c:(i + 1) * c], pos) for i, pos in enumerate((frame, row, col))]
        return torch.cat([*chunks, x[..., 3 * c:]], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, self.heads, self.head_width).transpose(1, 2)
                   for f in (self.to_q, self.to_k, self.to_v))
        q, k = self.turn(q), self.turn(k)
        weights = (q @ k.transpose(-1, -2) / self.head_width ** 0.5).softmax(dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, -1))


class NotTurned(SkewedRotary):
    def turn(self, x: torch.Tensor) -> torch.Tensor:
        return x
