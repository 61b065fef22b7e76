"""Which argument of a forward takes a --mask file (docs/trace.md, "Which argument takes the mask"): Swin's window
attention, whose optional `mask` is the shifted windows' mask [n_windows, N, N] (the whole [n, n] pattern a --mask
file gives makes it raise: it runs at its default and the file is the reference's mask alone); a key padding named
without "mask", read as the mask from its use.

    attnscope trace docs/examples/mask_args.py:WindowAttention --nq 16 --batch 2 --mask docs/examples/windows_16x16.npy
    attnscope trace docs/examples/mask_args.py:PaddedKeys --nq 9 --batch 2 --mask docs/examples/pad_2x9.npy
"""

import torch.nn as nn


class WindowAttention(nn.Module):
    """Swin's window attention over a 4 x 4 grid of tokens (its rows one after the other) in 2 x 2 windows."""

    def __init__(self, dim=24, num_heads=2, grid=4, window_size=2):
        super().__init__()
        self.num_heads, self.grid, self.ws = num_heads, grid, window_size
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        B, L, C = x.shape
        g, ws, h = self.grid, self.ws, self.num_heads
        w = x.view(B, g // ws, ws, g // ws, ws, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, C)
        B_, N, _ = w.shape
        q, k, v = self.qkv(w).reshape(B_, N, 3, h, C // h).permute(2, 0, 3, 1, 4)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        if mask is not None:  # the shifted windows' mask, [n_windows, N, N]
            nW = mask.shape[0]
            attn = (attn.view(B_ // nW, nW, h, N, N) + mask.unsqueeze(1).unsqueeze(0)).view(-1, h, N, N)
        w = self.proj((attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(B_, N, C))
        w = w.view(B, g // ws, g // ws, ws, ws, C).permute(0, 1, 3, 2, 4, 5)
        return w.reshape(B, L, C)


class PaddedKeys(nn.Module):
    """A key padding named without "mask" (True = a real token), read as the mask from its use: masked_fill on the
    scores.

        attnscope trace docs/examples/mask_args.py:PaddedKeys --nq 9 --batch 2 --mask docs/examples/pad_2x9.npy
    """

    def __init__(self, dim=24, heads=2):
        super().__init__()
        self.h = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, key_padding=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) * (C // self.h) ** -0.5
        if key_padding is not None:
            s = s.masked_fill(~key_padding.bool()[:, None, None, :], float("-inf"))
        return self.proj((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))
