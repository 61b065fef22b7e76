"""Time-first code that masks by itself (a causal buffer), run without --causal: round 13a's ChatGLM case."""

import math

import torch
from torch import nn


class BufferedTimeFirst(nn.Module):
    """[T, B, C] in and out, separate projections, a registered causal buffer sliced to the length, bmm over
    heads folded into the batch (fairseq's layout) with its own mask."""

    def __init__(self, embed_dim=24, num_heads=3, max_len=32):
        super().__init__()
        self.h, self.d = num_heads, embed_dim // num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)), persistent=False)

    def forward(self, query):
        t, b, c = query.shape
        q, k, v = (p(query).reshape(t, b * self.h, self.d).transpose(0, 1) for p in (self.q_proj, self.k_proj,
                                                                                    self.v_proj))
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(self.d)
        scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
        y = torch.bmm(scores.softmax(-1), v)  # [B·H, T, d]
        return self.out_proj(y.transpose(0, 1).reshape(t, b, c))
