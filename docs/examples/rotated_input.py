"""A self-attention that turns its input by position (rotary, rotate-half) before its query and key projections read
it, its value projection reading the input as it is, as HF Wav2Vec2-Conformer's rotary attention writes it
(docs/trace.md, "A tensor only the queries and keys read")."""

import torch
from torch import nn


class RotaryInputAttention(nn.Module):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.d, self.bug = heads, dim // heads, bug
        self.linear_q, self.linear_k, self.linear_v, self.linear_out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, n, dim = x.shape
        angle = torch.outer(torch.arange(n).float(), 10000.0 ** (-torch.arange(0, self.d, 2).float() / self.d))
        angle = torch.cat([angle, angle], -1)[:, None, :]
        h = x.view(b, n, self.heads, self.d)
        half = torch.cat([-h[..., self.d // 2:], h[..., : self.d // 2]], -1)
        turned = (h * angle.cos() + half * angle.sin()).view(b, n, dim)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2)
                   for t in (self.linear_q(turned), self.linear_k(turned),
                             self.linear_v(turned if self.bug == "values_turned" else x)))
        attn = (q @ k.transpose(-1, -2) / self.d ** 0.5).softmax(dim=-1)
        return self.linear_out((attn @ v).transpose(1, 2).reshape(b, n, dim))
