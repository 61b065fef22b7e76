"""A ViT attention that builds its own 2-D RoPE tables, as timm's EVA-02 does (pos_embed_rope.py: RotaryEmbeddingCat,
sin and cos of a patch grid's rows and columns, each angle laid for one pairing, split from one tensor and applied by
apply_rot_embed_cat to the patch tokens, the cls token kept aside). `layout` "interleaved" lays each angle twice in a
row (repeat_interleave(2)) and rotates 2i with 2i + 1 (timm's rot); "half" lays the angles once in each half and
rotates i with i + d/2 (transformers' rotate_half). Plant `other_rotation`: the tables of one pairing with the other
pairing's rotation. `heads_after`: q and k turned as `[b, n, heads, d]`, the tables unsqueezed to `[n, 1, d]`
(Qwen2-VL's and GLM-4V's vision rotary)."""

from __future__ import annotations

import torch
from torch import nn


def rot_interleaved(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class GridRopeAttention(nn.Module):
    def __init__(self, dim: int = 64, num_heads: int = 4, grid: int = 3, layout: str = "interleaved",
                 bug: str | None = None, heads_after: bool = False):
        super().__init__()
        self.heads_after = heads_after
        self.num_heads, self.head_dim, self.grid, self.layout, self.bug = num_heads, dim // num_heads, grid, layout, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        quarter = self.head_dim // 4
        self.register_buffer("bands", 1.0 / (100.0 ** (torch.arange(quarter) / quarter)), persistent=False)

    def rope(self) -> torch.Tensor:
        rows, cols = torch.meshgrid(torch.arange(self.grid), torch.arange(self.grid), indexing="ij")
        angles = torch.cat([rows.reshape(-1, 1) * self.bands, cols.reshape(-1, 1) * self.bands], -1)  # [n, d/2]
        laid = angles.repeat_interleave(2, -1) if self.layout == "interleaved" else torch.cat([angles, angles], -1)
        return torch.cat([laid.sin(), laid.cos()], -1)

    def _turn(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        sin, cos = emb.tensor_split(2, -1)
        interleaved = (self.layout == "interleaved") != (self.bug == "other_rotation")
        return x * cos + (rot_interleaved(x) if interleaved else rotate_half(x)) * sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        emb = self.rope()
        if self.heads_after:  # [b, n, heads, d], each token's row of the tables over its heads
            q, k, emb = q.transpose(1, 2), k.transpose(1, 2), emb.unsqueeze(-2)
            q = torch.cat([q[:, :1], self._turn(q[:, 1:], emb)], dim=1).transpose(1, 2)
            k = torch.cat([k[:, :1], self._turn(k[:, 1:], emb)], dim=1).transpose(1, 2)
        else:
            q = torch.cat([q[:, :, :1], self._turn(q[:, :, 1:], emb)], dim=2)
            k = torch.cat([k[:, :, :1], self._turn(k[:, :, 1:], emb)], dim=2)
        attn = (q * self.head_dim ** -0.5) @ k.transpose(-2, -1)
        out = attn.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, c))
