"""Neighbourhood attention written in PyTorch, as NAT's and Dinat's NATTEN kernels compute it: each query attends
to the `kernel` keys of a window around it (clamped at the borders so that it always holds `kernel` tokens), the
keys gathered for every query, `[b, h, n, kernel, d]`, and a learned relative-position table `rpb` added per
(query, neighbour) cell, indexed by the neighbour's offset. Each class takes `bug` to plant one mistake."""

import math

import torch
from torch import nn


def windows(n: int, kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's window of `kernel` positions, clamped to [0, n), and each neighbour's offset index into a
    table of 2·kernel - 1 entries (neighbour - query + kernel - 1)."""
    start = (torch.arange(n) - kernel // 2).clamp(0, n - kernel)
    window = start[:, None] + torch.arange(kernel)
    return window, window - torch.arange(n)[:, None] + kernel - 1


def allowed(n: int, kernel: int) -> torch.Tensor:
    """[n, n], True where a query's window holds the key."""
    out = torch.zeros(n, n, dtype=torch.bool)
    out.scatter_(1, windows(n, kernel)[0], True)
    return out


def allowed_2d(height: int, width: int, kernel: int) -> torch.Tensor:
    rows, cols = allowed(height, kernel), allowed(width, kernel)
    return (rows[:, None, :, None] & cols[None, :, None, :]).reshape(height * width, height * width)


class Neighbourhood1d(nn.Module):
    """NAT 1-D on a sequence [b, n, c]: separate q, k, v Linear layers, the keys and values gathered by index."""

    def __init__(self, dim=32, heads=4, kernel=3, bug=""):
        super().__init__()
        self.heads, self.kernel, self.bug = heads, kernel, bug
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))
        self.rpb = nn.Parameter(torch.randn(heads, 2 * kernel - 1) * 0.5)

    def forward(self, x):
        b, n, c = x.shape
        d = c // self.heads
        q, k, v = (f(x).view(b, n, self.heads, d).transpose(1, 2) for f in (self.q, self.k, self.v))  # [b, h, n, d]
        if self.bug == "kv_swapped":
            k, v = v, k
        scale = 1.0 if self.bug == "no_scale" else d ** -0.5
        window, offset = windows(n, self.kernel)
        s = torch.einsum("bhnd,bhnkd->bhnk", q * scale, k[:, :, window])  # [b, h, n, kernel]
        bias = self.rpb[:, offset]  # [h, n, kernel]
        if self.bug != "bias_after_softmax":
            s = s + bias
        a = s.softmax(dim=-1)
        if self.bug == "bias_after_softmax":
            a = a + bias
        out = torch.einsum("bhnk,bhnkd->bhnd", a, v[:, :, window])
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class Neighbourhood2d(nn.Module):
    """NAT 2-D on a feature map [b, h, w, c]: one fused qkv Linear, the neighbours of each pixel flat, each query a
    row of one against its neighbours' keys (`q.unsqueeze(-2) @ k_near.transpose(-2, -1)`), a table `rpb` [heads,
    2k-1, 2k-1] looked up by the row and column offsets."""

    def __init__(self, dim=24, heads=3, kernel=3, bug=""):
        super().__init__()
        self.heads, self.kernel, self.bug = heads, kernel, bug
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.rpb = nn.Parameter(torch.randn(heads, 2 * kernel - 1, 2 * kernel - 1) * 0.5)

    def forward(self, x):
        b, height, width, c = x.shape
        d = c // self.heads
        qkv = self.qkv(x).reshape(b, height * width, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # [b, heads, n, d]
        rows, row_offset = windows(height, self.kernel)
        cols, col_offset = windows(width, self.kernel)
        near = (rows[:, None, :, None] * width + cols[None, :, None, :]).reshape(height * width, -1)  # [n, k·k]
        s = (q.unsqueeze(-2) @ k[:, :, near].transpose(-2, -1)).squeeze(-2) / math.sqrt(d)  # [b, heads, n, k·k]
        s = s + self.rpb[:, row_offset[:, None, :, None], col_offset[None, :, None, :]].reshape(
            self.heads, height * width, -1)
        a = s.softmax(-1)
        out = (a.unsqueeze(-2) @ v[:, :, near]).squeeze(-2)  # [b, heads, n, d]
        if self.bug == "merge_without_transpose":
            out = out.reshape(b, height, width, c)
        else:
            out = out.transpose(1, 2).reshape(b, height, width, c)
        return self.proj(out)
