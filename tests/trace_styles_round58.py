"""Styles for tests/test_trace_round58.py, written afresh.

GroupedPointwise: SqueezeBERT-like self-attention on channels-first activations `[B, C, N]`, its q, k and v each a
grouped 1×1 convolution (`nn.Conv1d(C, C, 1, groups=4)`: each token alone, a block-diagonal Linear), the scores
`q^T k`, a key-padding mask added, the output `[B, C, N]` again. bug='scale_by_width' divides by √C;
bug='query_softmax' takes the softmax over the queries."""

import torch
from torch import nn


class GroupedPointwise(nn.Module):
    def __init__(self, channels=32, heads=4, groups=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.query = nn.Conv1d(channels, channels, 1, groups=groups)
        self.key = nn.Conv1d(channels, channels, 1, groups=groups)
        self.value = nn.Conv1d(channels, channels, 1, groups=groups)

    def forward(self, hidden_states, attention_mask=None):
        b, c, n = hidden_states.shape
        d = c // self.heads
        q = self.query(hidden_states).view(b, self.heads, d, n).permute(0, 1, 3, 2)  # [b, h, n, d]
        k = self.key(hidden_states).view(b, self.heads, d, n)
        v = self.value(hidden_states).view(b, self.heads, d, n).permute(0, 1, 3, 2)
        scores = torch.matmul(q, k) / (c if self.bug == "scale_by_width" else d) ** 0.5  # [b, h, n, n]
        if attention_mask is not None:
            scores = scores + attention_mask
        out = torch.matmul(scores.softmax(dim=-2 if self.bug == "query_softmax" else -1), v)  # [b, h, n, d]
        return out.permute(0, 1, 3, 2).reshape(b, c, n)
