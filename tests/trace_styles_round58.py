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


class PerHeadWidths(nn.Module):
    """EfficientFormer's and LeViT's meta-block attention as written afresh: one fused qkv Linear laid out per head
    as [key_dim | key_dim | value_dim] (the values wider than the keys), viewed per head and split along the last
    axis; a bias per head and per grid offset, `torch.zeros` until trained, gathered by an index buffer and kept as
    a plain tensor by a `train()` override (never in the forward's own ops)."""

    def __init__(self, dim=32, key_dim=4, heads=4, ratio=2, side=3, bug=""):
        super().__init__()
        self.heads, self.key_dim, self.value_dim, self.bug = heads, key_dim, ratio * key_dim, bug
        self.qkv = nn.Linear(dim, heads * (2 * key_dim + self.value_dim))
        self.proj = nn.Linear(heads * self.value_dim, dim)
        cells = [(i, j) for i in range(side) for j in range(side)]
        offsets = sorted({(abs(a[0] - b[0]), abs(a[1] - b[1])) for a in cells for b in cells})
        index = [offsets.index((abs(a[0] - b[0]), abs(a[1] - b[1]))) for a in cells for b in cells]
        self.table = nn.Parameter(torch.zeros(heads, len(offsets)))
        self.register_buffer("offset_index", torch.tensor(index).view(len(cells), len(cells)), persistent=False)

    @torch.no_grad()
    def train(self, mode=True):
        super().train(mode)
        self.cached = None if mode else self.table[:, self.offset_index]
        return self

    def forward(self, x):
        b, n, _ = x.shape
        if self.bug == "split_without_permute":  # straight to heads-first, the tokens mixed into the heads
            q, k, v = self.qkv(x).reshape(b, self.heads, n, -1).split([self.key_dim, self.key_dim, self.value_dim], 3)
        else:
            q, k, v = self.qkv(x).view(b, n, self.heads, -1).split([self.key_dim, self.key_dim, self.value_dim], 3)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        bias = self.table[:, self.offset_index] if self.training else self.cached
        s = q @ k.transpose(-2, -1) * self.key_dim ** -0.5
        a = (s if self.bug == "bias_after_softmax" else s + bias).softmax(-1)
        if self.bug == "bias_after_softmax":
            a = a + bias
        return self.proj((a @ v).transpose(1, 2).reshape(b, n, -1))


class MaskedOnes(nn.Module):
    """CTRL's attention as written afresh: the mask 1 where a key is masked (`triu(ones, 1)`, handed in), added as
    `mask * -1e4`; the plant multiplies the scores by the keep indicator `1 - mask` instead."""

    def __init__(self, dim=32, heads=4, bug=""):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.Wq, self.Wk, self.Wv, self.dense = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = (w(x).reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for w in (self.Wq, self.Wk, self.Wv))
        logits = q @ k.permute(0, 1, 3, 2) / (d // self.heads) ** 0.5
        if self.bug == "multiplied":
            logits = logits * (1 - mask)
        else:
            logits = logits + mask * -1e4
        out = logits.softmax(-1) @ v
        return self.dense(out.permute(0, 2, 1, 3).reshape(b, n, d))


class PBRelax(nn.Module):
    """LayoutLMv3's and CogView's PB-relax softmax as written afresh: the scores divided by α, each query's max taken
    out, multiplied back by α, then the softmax; the plant runs it over the queries (dim=-2)."""

    def __init__(self, dim=32, heads=4, alpha=32, bug=""):
        super().__init__()
        self.heads, self.alpha, self.bug = heads, alpha, bug
        self.query, self.key, self.value, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).transpose(1, 2) for f in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        relaxed = scores / self.alpha
        relaxed = (relaxed - relaxed.amax(dim=-1, keepdim=True)) * self.alpha
        probs = relaxed.softmax(dim=-2 if self.bug == "softmax_queries" else -1)
        return self.out((probs @ v).transpose(1, 2).reshape(b, n, d))
