"""nGPT's attention, shrunk, for docs/trace.md ("How conventions are read"): q and k rotated (interleaved pairs),
then normalized to unit length and multiplied by a learned gain per channel, `sqk · q / ‖q‖`, computed from one
parameter and viewed one row a head; the softmax scale √d_head (the unit rows' convention, `--scale`).

`bug=` plants a mistake: "values_from_keys".
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class NormalizedAttention(nn.Module):
    def __init__(self, n_embd=32, n_head=4, bug=None):
        super().__init__()
        self.n_head, self.d, self.bug = n_head, n_embd // n_head, bug
        self.query = nn.Linear(n_embd, n_embd, bias=False)
        self.key = nn.Linear(n_embd, n_embd, bias=False)
        self.value = nn.Linear(n_embd, n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)
        self.sqk_scale = 1.0 / math.sqrt(n_embd)
        self.sqk = nn.Parameter(self.sqk_scale * torch.linspace(0.5, 1.5, n_embd))  # trained: a gain a channel

    def rotate(self, x):  # [B, T, H, D], pairs (2i, 2i + 1)
        inv = 10000.0 ** (-torch.arange(0, self.d, 2, dtype=x.dtype) / self.d)
        a = torch.outer(torch.arange(x.shape[1], dtype=x.dtype), inv)[None, :, None, :]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * a.cos() - odd * a.sin(), even * a.sin() + odd * a.cos()), dim=-1).flatten(-2)

    def forward(self, h):
        B, T, C = h.shape
        q = self.rotate(self.query(h).view(B, T, self.n_head, self.d))
        k = self.rotate(self.key(h).view(B, T, self.n_head, self.d))
        v = (self.key(h) if self.bug == "values_from_keys" else self.value(h)).view(B, T, self.n_head, self.d)
        sqk = (self.sqk / self.sqk_scale).view(1, 1, self.n_head, self.d)
        q, k = sqk * (q / q.norm(dim=-1, keepdim=True)), sqk * (k / k.norm(dim=-1, keepdim=True))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           scale=math.sqrt(self.d))
        return self.proj(y.transpose(1, 2).reshape(B, T, C))
