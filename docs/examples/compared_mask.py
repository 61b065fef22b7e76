"""A decoder attention that reads transformers' 4-D additive mask by comparing it with 0 (docs/trace.md, "Masks in
every convention"): `where(mask < 0, finfo.min, scores)` before the softmax. `bug='after'` zeroes the masked
weights after the softmax instead, `masked_fill(mask < 0, 0.0)`:

    attnscope trace docs/examples/compared_mask.py:ComparedMask --causal
    attnscope trace docs/examples/compared_mask.py:ComparedMask --init "bug='after'" --causal
"""

import torch
import torch.nn as nn


class ComparedMask(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        b, n, _ = hidden_states.shape
        shape = (b, n, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # [b, h, n, d]
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) * self.head_dim ** -0.5  # [b, h, n, n]
        if attention_mask is not None and self.bug != "after":
            scores = torch.where(attention_mask < 0, torch.finfo(scores.dtype).min, scores)
        weights = scores.softmax(dim=-1)
        if attention_mask is not None and self.bug == "after":
            weights = weights.masked_fill(attention_mask < 0, 0.0)
        out = (weights @ v).transpose(1, 2).reshape(b, n, -1)
        return self.o_proj(out)
