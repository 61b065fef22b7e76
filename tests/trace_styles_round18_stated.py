"""Styles of one file whose words give their boolean masks opposite meanings, each in the docstring of a method of its
own that lays the mask out (not on the line that applies it): a module whose mask is True where a key may be
attended, one beside it whose 1 marks a masked key, and one that says nothing. Each reads the mask as its own words
say (or, saying nothing, as its ops do); `bug='flipped'` reads it the other way round. No class's words are
another's."""

from __future__ import annotations

import torch
from torch import nn


class _Heads(nn.Module):
    def __init__(self, d_model=24, n_head=3, bug=None):
        super().__init__()
        self.qkv, self.out, self.n_head = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model), n_head
        self.bug = bug

    def scores(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        return q @ k.transpose(-2, -1) / (c // self.n_head) ** 0.5, v  # [b, h, n, n], [b, h, n, d]

    def merged(self, weights, v):
        b, h, n, d = v.shape
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, h * d))


class KeepWords(_Heads):
    def laid(self, mask):
        """mask [b, n_Q, n_K], boolean: True where a key may be attended; laid out for the heads."""
        return mask.unsqueeze(-3)  # [b, n_Q, n_K] -> [b, 1, n_Q, n_K]

    def forward(self, x, mask=None):
        s, v = self.scores(x)
        if mask is not None:
            s = s.masked_fill(self.laid(mask) if self.bug == "flipped" else ~self.laid(mask), float("-inf"))
        return self.merged(s.softmax(-1), v)


class MaskedWords(_Heads):
    def laid(self, mask):
        """mask [b, n_Q, n_K] of 0 and 1, 1 = masked; laid out for the heads."""
        return mask.unsqueeze(-3)  # [b, n_Q, n_K] -> [b, 1, n_Q, n_K]

    def forward(self, x, mask=None):
        s, v = self.scores(x)
        if mask is not None:
            s = s.masked_fill(self.laid(mask) == (0 if self.bug == "flipped" else 1), torch.finfo(s.dtype).min)
        return self.merged(s.softmax(-1), v)


class NoWords(_Heads):
    def forward(self, x, mask=None):
        s, v = self.scores(x)
        if mask is not None:
            s = s.masked_fill(mask == 0, float("-inf"))
        return self.merged(s.softmax(-1), v)
