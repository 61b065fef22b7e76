"""Attention within mask units with pooled queries, in the style of transformers' HieraMaskUnitAttention
(models/hiera/modeling_hiera.py): the tokens already unrolled so that token t sits in unit t % num_windows, one fused
qkv Linear viewed [B, tokens_per_window, num_windows, 3, heads, head_dim], the queries max-pooled over query_stride
inside each unit, `(query * scale) @ key.mT`, softmax, `@ value`, `transpose(1, 3)` and the output projection.
head_dim 16 makes twice the scale (1/4 · 1/4) the same number as 1/head_dim. Plant `scale_twice`: the scores scaled
again after the product."""

from __future__ import annotations

import torch
from torch import nn


class MaskUnitAttention(nn.Module):
    def __init__(self, hidden_size: int = 32, hidden_size_output: int = 64, num_heads: int = 4, query_stride: int = 4,
                 window_size: int = 2, bug: str | None = None):
        super().__init__()
        self.num_heads, self.query_stride, self.window_size = num_heads, query_stride, window_size
        self.hidden_size_output, self.bug = hidden_size_output, bug
        self.head_dim = hidden_size_output // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size_output)
        self.proj = nn.Linear(hidden_size_output, hidden_size_output)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, seq_len, _ = hidden_states.shape
        tokens_per_window = self.query_stride * self.window_size
        num_windows = seq_len // tokens_per_window
        qkv = self.qkv(hidden_states).reshape(batch_size, tokens_per_window, num_windows, 3, self.num_heads,
                                              self.head_dim).permute(3, 0, 4, 2, 1, 5)
        query, key, value = qkv.unbind(0)
        query = query.view(batch_size, self.num_heads, num_windows, self.query_stride, -1, self.head_dim)
        query = query.max(dim=3).values
        attn_weights = (query * self.scale) @ key.transpose(-1, -2)
        if self.bug == "scale_twice":
            attn_weights = attn_weights * self.scale
        attn_output = attn_weights.softmax(dim=-1) @ value
        attn_output = attn_output.transpose(1, 3).reshape(batch_size, -1, self.hidden_size_output)
        return self.proj(attn_output)
