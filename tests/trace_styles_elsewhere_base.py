"""A base attention written in one file and used from another (trace_styles_elsewhere.py): qkv fused in one Linear
split by `chunk`, heads split with `unflatten` and `transpose`, a causal mask from `torch.triu`, the softmax over the
keys, the heads merged with `flatten`. `bug` plants one mistake: "scale_d_model" divides by sqrt(d_model),
"softmax_queries" takes the softmax over the queries."""

import math

import torch
from torch import nn


class FusedCausalAttention(nn.Module):
    def __init__(self, width=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        width = x.shape[-1] if self.bug == "scale_d_model" else q.shape[-1]
        scores = q @ k.transpose(-2, -1) / math.sqrt(width)
        n = x.shape[1]
        future = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
        weights = scores.softmax(dim=-2 if self.bug == "softmax_queries" else -1)
        out = (weights @ v).transpose(1, 2).flatten(2)
        return self.proj(out)


def attend(q, k, v, mask=None):
    """Scaled dot-product attention of [batch, heads, n, d_head] tensors; `mask` True = may attend."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v
