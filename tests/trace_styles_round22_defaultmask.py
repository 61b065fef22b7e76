"""Styles of our own for tests/test_trace_round22_defaultmask.py: a mask parameter whose default, made by the module
when it is given None, tells which way round the module takes it (round 22's AllenNLP MultiHeadSelfAttention:
`inputs.new_ones(batch, timesteps)`). Weights moved off their initial values; no docstring or comment here says
which way round a mask is taken.

- OnesDefault: a [batch, n] key mask, `x.new_ones(b, n)` by default, heads folded into the batch, the mask repeated
  per head, `masked_fill(~mask.bool(), finfo.min)`. `bug`: 'polarity' (`masked_fill(mask.bool(), ..)`).
- WhereDefault: `torch.ones(b, n, dtype=torch.bool)` by default, `torch.where(mask[:, None, None], scores, -inf)`.
  `bug`: 'polarity' (`torch.where(mask, -inf, scores)`).
- PaddingDefault: fairseq-like `key_padding_mask`, `x.new_zeros(b, n, dtype=bool)` by default, applied as
  `masked_fill(key_padding_mask[:, None, None], -inf)`. `bug`: 'polarity' (`~key_padding_mask`).
"""

from __future__ import annotations

import torch
from torch import nn


def trained(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


class _Heads(nn.Module):
    def __init__(self, dim: int, heads: int, seed: int) -> None:
        super().__init__()
        self.h, self.d = heads, dim // heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        trained(self, seed)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [B, n, C] -> 3 × [B, h, n, d]
        b, n, _ = x.shape
        return tuple(self.qkv(x).view(b, n, 3, self.h, self.d).permute(2, 0, 3, 1, 4))

    def merge(self, o: torch.Tensor) -> torch.Tensor:  # [B, h, n, d] -> [B, n, C]
        return self.out(o.transpose(1, 2).flatten(2))


class OnesDefault(_Heads):
    def __init__(self, dim=32, heads=4, bug=""):
        super().__init__(dim, heads, 31)
        self.bug = bug

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        if mask is None:
            mask = x.new_ones(b, n)
        q, k, v = (t.reshape(b * self.h, n, self.d) for t in self.split(x))  # [B·h, n, d]
        scores = torch.bmm(q / self.d ** 0.5, k.transpose(1, 2))  # [B·h, n, n]
        keep = mask.repeat(1, self.h).view(b * self.h, n).bool().unsqueeze(1)  # [B·h, 1, n]
        scores = scores.masked_fill(keep if self.bug == "polarity" else ~keep, torch.finfo(scores.dtype).min)
        return self.merge(torch.bmm(scores.softmax(-1), v).view(b, self.h, n, self.d))


class WhereDefault(_Heads):
    def __init__(self, dim=32, heads=4, bug=""):
        super().__init__(dim, heads, 32)
        self.bug = bug

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        if mask is None:
            mask = torch.ones(b, n, dtype=torch.bool)
        q, k, v = self.split(x)
        scores = q @ k.transpose(-2, -1) * self.d ** -0.5  # [B, h, n, n]
        m = mask[:, None, None, :]
        scores = torch.where(m, float("-inf"), scores) if self.bug == "polarity" \
            else torch.where(m, scores, float("-inf"))
        return self.merge(scores.softmax(-1) @ v)


class PaddingDefault(_Heads):
    def __init__(self, dim=32, heads=4, bug=""):
        super().__init__(dim, heads, 33)
        self.bug = bug

    def forward(self, x, key_padding_mask=None):
        b, n, _ = x.shape
        if key_padding_mask is None:
            key_padding_mask = x.new_zeros(b, n, dtype=torch.bool)
        q, k, v = self.split(x)
        scores = q @ k.transpose(-2, -1) / self.d ** 0.5
        pad = key_padding_mask[:, None, None, :]
        scores = scores.masked_fill(~pad if self.bug == "polarity" else pad, float("-inf"))
        return self.merge(scores.softmax(-1) @ v)
