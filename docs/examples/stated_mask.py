"""A multi-head module whose scaled-dot-product helper says, on its masking line, how it reads its mask, and a copy
of it that masks the other way round (docs/trace.md, "A mask whose polarity the code's words say")."""

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, d_model=24, n_head=3):
        super().__init__()
        self.n_head, self.d_head = n_head, d_model // n_head
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def attend(self, q, k, v, mask):
        scores = q @ k.transpose(-2, -1) / self.d_head ** 0.5
        scores = scores.masked_fill(~mask, float("-inf"))  # mask: True where a query may attend to a key
        return torch.softmax(scores, dim=-1) @ v

    def forward(self, x, mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.n_head, self.d_head).permute(2, 0, 3, 1, 4)
        out = self.attend(q, k, v, mask)
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


class Flipped(Attention):
    def attend(self, q, k, v, mask):
        scores = q @ k.transpose(-2, -1) / self.d_head ** 0.5
        scores = scores.masked_fill(mask, float("-inf"))  # mask: True where a query may attend to a key
        return torch.softmax(scores, dim=-1) @ v
