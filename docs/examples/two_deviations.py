"""Two deviations at once (docs/trace.md, "Two deviations at once"): ALiBi's bias written symmetric, −m_h · |i − j|
(x-transformers' AlibiPositionalBias, MosaicBERT's), which a causal mask makes the reference's own, with a mask
mistake that shows the keys after the query; and two mistakes at once."""

import torch
import torch.nn as nn


class SymmetricAlibi(nn.Module):
    def __init__(self, dim=16, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.register_buffer("slopes", torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)]))

    def forward(self, x):
        b, n, dim = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # 3 × [b, heads, n, d_head]
        scale = 1.0 if self.bug == "no_scale_fill0" else q.shape[-1] ** -0.5
        scores = q @ k.transpose(-1, -2) * scale  # [b, heads, n, n]
        pos = torch.arange(n)
        scores = scores - self.slopes[:, None, None] * (pos[None, :] - pos[:, None]).abs()  # −m_h · |i − j|
        masked = torch.ones(n, n, dtype=torch.bool).triu(2 if self.bug == "causal_wide" else 1)
        scores = scores.masked_fill(masked, 0.0 if self.bug == "no_scale_fill0" else float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, dim))
