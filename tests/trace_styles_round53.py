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


class LinearBatchNorm(nn.Module):
    """A Linear without bias, then BatchNorm1d over the tokens flattened (LeViT's MLPLayerWithBN)."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=False)
        self.batch_norm = nn.BatchNorm1d(d_out)

    def forward(self, x):
        y = self.linear(x)
        return self.batch_norm(y.flatten(0, 1)).reshape_as(y)


class BatchNormedAttention(nn.Module):
    """LeViT-like attention: q, k and v cut per head from one LinearBatchNorm as [key_dim | key_dim | 2·key_dim],
    the values twice as wide as the keys, scale key_dim^-0.5, the heads merged into a LinearBatchNorm. `bug`:
    "softmax_queries", "merge_no_transpose"."""

    def __init__(self, dim=32, key_dim=8, heads=4, bug=None):
        super().__init__()
        self.heads, self.key_dim, self.bug = heads, key_dim, bug
        self.qkv = LinearBatchNorm(dim, heads * 4 * key_dim)
        self.proj = LinearBatchNorm(heads * 2 * key_dim, dim)
        with torch.no_grad():  # a trained checkpoint's statistics and affine, not BatchNorm's start
            for norm in (self.qkv.batch_norm, self.proj.batch_norm):
                norm.running_mean.normal_(0.0, 0.5)
                norm.running_var.uniform_(0.5, 2.0)
                norm.weight.normal_(1.0, 0.3)
                norm.bias.normal_(0.0, 0.3)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, self.heads, -1).split([self.key_dim, self.key_dim, 2 * self.key_dim], dim=3)
        q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        weights = (q @ k.transpose(-2, -1) * self.key_dim ** -0.5).softmax(dim=-2 if self.bug == "softmax_queries"
                                                                           else -1)
        out = weights @ v
        out = out.reshape(b, n, -1) if self.bug == "merge_no_transpose" else out.transpose(1, 2).reshape(b, n, -1)
        return self.proj(out)
