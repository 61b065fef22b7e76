"""Neighbourhood attention as NAT and Dinat compute it (NATTEN's kernels, written in PyTorch): each token attends to
the `kernel` tokens of a window around it, clamped at the borders, its keys gathered for it, and a learned table
`rpb` adds a bias per (query, neighbour) by the neighbour's offset. `bug` plants one mistake."""

import torch
from torch import nn


class NeighbourhoodAttention(nn.Module):
    def __init__(self, dim=32, heads=4, kernel=3, bug=""):
        super().__init__()
        self.heads, self.kernel, self.bug = heads, kernel, bug
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.rpb = nn.Parameter(torch.randn(heads, 2 * kernel - 1) * 0.5)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        start = (torch.arange(n) - self.kernel // 2).clamp(0, n - self.kernel)
        near = start[:, None] + torch.arange(self.kernel)  # [n, kernel]: each query's keys
        offset = near - torch.arange(n)[:, None] + self.kernel - 1
        s = torch.einsum("bhnd,bhnkd->bhnk", q, k[:, :, near]) * q.shape[-1] ** -0.5
        bias = self.rpb[:, offset]  # [heads, n, kernel]
        if self.bug != "bias_after_softmax":
            s = s + bias
        a = s.softmax(-1)
        if self.bug == "bias_after_softmax":
            a = a + bias
        out = torch.einsum("bhnk,bhnkd->bhnd", a, v[:, :, near])
        return self.proj(out.transpose(1, 2).reshape(b, n, c))
