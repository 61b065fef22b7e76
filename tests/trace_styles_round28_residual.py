"""Styles for tests/test_trace_round28_residual.py: a second required tensor the code never projects and never
combines with its scores, under a name that says nothing of its role.

- `ShortcutBlock`: `forward(hidden, shortcut, attn_mask=None)`: the shortcut added to what it returns
  (`shortcut + self.proj(out)`), an additive mask on the scores.
- `ReturnedResidual`: `forward(x, residual)`, `out = self.o(..)`, then `out = out + residual`, `return out`.
- `QueryEmbed`: DETR's self-attention with the position embedding named `query_embed`: `qk = tgt + query_embed`,
  q and k projected from it, v from `tgt` alone.
- `SoftmaxLayer`: vit-pytorch's `self.attend = nn.Softmax(dim=-1)` over `self.drop(dots + bias)`: the bias is the mask.
- `MemoryPlusPos`: DETR's cross-attention, for contrast: `self.k(memory + pos)`, `self.v(memory)`: memory is the
  keys' input (projected alone), never a residual.
"""

import torch.nn as nn
from _trace_ref import trained


class _Heads(nn.Module):
    def __init__(self, dim, heads, seed, names=("q", "k", "v", "proj")):
        super().__init__()
        self.heads = heads
        for name in names:
            setattr(self, name, nn.Linear(dim, dim))
        trained(self, seed)

    def split(self, t):
        B, N, C = t.shape
        return t.view(B, N, self.heads, C // self.heads).transpose(1, 2)

    @staticmethod
    def merge(t):
        B, H, N, D = t.shape
        return t.transpose(1, 2).reshape(B, N, H * D)


class ShortcutBlock(_Heads):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__(dim, heads, 40)
        self.bug = bug

    def forward(self, hidden, shortcut, attn_mask=None):
        q, k, v = self.split(self.q(hidden)), self.split(self.k(hidden)), self.split(self.v(hidden))
        scores = q @ k.transpose(-2, -1)
        scores = scores if self.bug == "no_scale" else scores * q.shape[-1] ** -0.5
        if attn_mask is not None:
            scores = scores + attn_mask
        attn = scores.softmax(dim=-1)
        return shortcut + self.proj(self.merge(attn @ v))


class ReturnedResidual(_Heads):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__(dim, heads, 41, names=("q", "k", "v", "o"))
        self.bug = bug

    def forward(self, x, residual):
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        if self.bug == "kv_swapped":
            k, v = v, k
        attn = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).softmax(dim=-1)
        out = self.o(self.merge(attn @ v))
        out = out + residual
        return out


class QueryEmbed(_Heads):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__(dim, heads, 42)
        self.bug = bug

    def forward(self, tgt, query_embed):
        qk = tgt + query_embed
        q, k, v = self.split(self.q(qk)), self.split(self.k(qk)), self.split(self.v(tgt))
        attn = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        return self.proj(self.merge(attn @ v))


class MemoryPlusPos(_Heads):
    def __init__(self, dim=32, heads=4):
        super().__init__(dim, heads, 43)

    def forward(self, tgt, memory, pos):
        q = self.split(self.q(tgt))
        k, v = self.split(self.k(memory + pos)), self.split(self.v(memory))
        attn = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(dim=-1)
        return self.proj(self.merge(attn @ v))


class SoftmaxLayer(_Heads):
    def __init__(self, dim=32, heads=4):
        super().__init__(dim, heads, 44)
        self.attend, self.drop = nn.Softmax(dim=-1), nn.Dropout(0.0)

    def forward(self, x, bias):
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        attn = self.attend(self.drop(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + bias))
        return self.proj(self.merge(attn @ v))
