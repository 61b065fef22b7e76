"""A prefix-LM attention (GIT's: the first `prefix` tokens see each other, the rest causally and every prefix token),
its mask built by the module itself, no output projection, for tests/test_trace_round53.py. `bug="future_diagonal"`
builds the causal part with `triu(..., diagonal=0)`: a text token no longer sees itself."""

import math

import torch
from torch import nn


class PrefixLMSelfAttention(nn.Module):
    def __init__(self, hidden_size=32, heads=4, prefix=3, bug=None):
        super().__init__()
        self.heads, self.d, self.prefix, self.bug = heads, hidden_size // heads, prefix, bug
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)

    def split(self, x):
        x = x.view(x.shape[0], x.shape[1], self.heads, self.d)
        return x.permute(0, 2, 1, 3)

    def prefix_mask(self, n, dtype):
        text = n - self.prefix
        future = torch.triu(torch.ones(text, text), diagonal=0 if self.bug == "future_diagonal" else 1)
        mask = torch.zeros(n, n)
        mask[: self.prefix, self.prefix:] = float("-inf")  # the prefix never sees the text
        mask[self.prefix:, self.prefix:] = future.masked_fill(future == 1, float("-inf"))
        return mask.to(dtype)

    def forward(self, hidden_states):
        q, k, v = self.split(self.query(hidden_states)), self.split(self.key(hidden_states)), \
            self.split(self.value(hidden_states))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        scores = scores + self.prefix_mask(hidden_states.shape[1], scores.dtype)
        context = scores.softmax(dim=-1) @ v
        return context.permute(0, 2, 1, 3).reshape(hidden_states.shape)
