"""HF SqueezeBert's self-attention over [B, C, W]: three 1x1 Conv1d projections, queries and values as [B, H, W, d],
keys as [B, H, d, W], a 4-D additive mask added with no test for None, and `forward(hidden_states, attention_mask,
output_attentions)` with no defaults, the flag read only as `if output_attentions:` (docs/trace.md, "A flag without a
default")."""

import math

import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, cin=32, heads=4):
        super().__init__()
        self.heads, self.head_size = heads, cin // heads
        self.query = nn.Conv1d(cin, cin, kernel_size=1)
        self.key = nn.Conv1d(cin, cin, kernel_size=1)
        self.value = nn.Conv1d(cin, cin, kernel_size=1)

    def split(self, x):  # [N, C, W] -> [N, H, d, W]
        return x.view(x.size(0), self.heads, self.head_size, x.size(-1))

    def forward(self, hidden_states, attention_mask, output_attentions):
        query = self.split(self.query(hidden_states)).permute(0, 1, 3, 2)  # [N, H, W, d]
        key = self.split(self.key(hidden_states))  # [N, H, d, W]
        value = self.split(self.value(hidden_states)).permute(0, 1, 3, 2)
        score = torch.matmul(query, key) / math.sqrt(self.head_size) + attention_mask
        probs = score.softmax(dim=-1)
        context = torch.matmul(probs, value).permute(0, 1, 3, 2).contiguous()  # [N, H, d, W]
        result = {"context_layer": context.view(context.size(0), -1, context.size(-1))}
        if output_attentions:
            result["attention_score"] = score
        return result
