"""Styles for tests/test_trace_round54.py, written afresh.

SymmetricAlibi: Jais' attention on GPT-2's frame (core42/jais modeling_jais.py): a fused c_attn split in three,
muP's scores scaled by 1 / d_head, GPT-2's causal buffer applied with torch.where, then ALiBi made symmetric,
-m_h · |i - j| (its AlibiPositionEmbeddingLayer); under the causal mask the same as ALiBi's -m_h · (i - j).
bug='after_softmax' adds that bias to the softmaxed weights, where the hidden cells above the diagonal no longer
cancel."""


import torch
from torch import nn


def _slopes(n_head):
    start = 2 ** (-8 / n_head)
    return torch.tensor([start ** (h + 1) for h in range(n_head)])


class SymmetricAlibi(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, max_positions=32, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.c_attn = nn.Linear(hidden_size, 3 * hidden_size)
        self.c_proj = nn.Linear(hidden_size, hidden_size)
        self.register_buffer("bias", torch.tril(torch.ones(max_positions, max_positions, dtype=torch.bool)),
                             persistent=False)
        self.register_buffer("slopes", _slopes(num_heads), persistent=False)

    def _alibi(self, n):
        context = torch.arange(n)[:, None]
        memory = torch.arange(n)[None, :]
        distance = (memory - context).abs()
        return -self.slopes[:, None, None] * distance[None]  # [heads, n, n]

    def forward(self, hidden_states):
        B, T, C = hidden_states.shape
        query, key, value = self.c_attn(hidden_states).split(C, dim=2)
        query, key, value = (t.view(B, T, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
                             for t in (query, key, value))
        attn_weights = torch.matmul(query, key.transpose(-1, -2)) / self.head_dim  # muP: 1 / d_head
        causal = self.bias[:T, :T]
        attn_weights = torch.where(causal, attn_weights, torch.finfo(attn_weights.dtype).min)
        position_bias = self._alibi(T).to(attn_weights.dtype)
        if self.bug != "after_softmax":
            attn_weights = attn_weights + position_bias.unsqueeze(0)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        if self.bug == "after_softmax":
            attn_weights = attn_weights + position_bias.unsqueeze(0)
        out = torch.matmul(attn_weights, value).permute(0, 2, 1, 3).reshape(B, T, C)
        return self.c_proj(out)




class OffsetBiasedAttention(nn.Module):
    """LeViT's attention (models/levit/modeling_levit.py, LevitAttention, its BatchNorms left out): a learned bias
    per head and per offset between two points of a 3×3 grid (`attention_biases[:, attention_bias_idxs]`) added to
    the scaled scores, values twice as wide as the keys, and a Hardswish on the merged heads before the projection.
    bug='after_softmax' adds the bias to the softmaxed weights."""

    def __init__(self, hidden_size=32, key_dim=8, num_heads=4, attention_ratio=2, resolution=3, bug=None):
        super().__init__()
        self.num_heads, self.key_dim, self.ratio, self.bug = num_heads, key_dim, attention_ratio, bug
        self.scale = key_dim ** -0.5
        self.out_dim = attention_ratio * key_dim * num_heads
        self.qkv = nn.Linear(hidden_size, self.out_dim + 2 * key_dim * num_heads)
        self.activation = nn.Hardswish()
        self.projection = nn.Linear(self.out_dim, hidden_size)
        points = [(x, y) for x in range(resolution) for y in range(resolution)]
        offsets, indices = {}, []
        for p1 in points:
            for p2 in points:
                offset = (abs(p1[0] - p2[0]), abs(p1[1] - p2[1]))
                indices.append(offsets.setdefault(offset, len(offsets)))
        self.attention_biases = nn.Parameter(0.7 * torch.randn(num_heads, len(offsets)))
        self.register_buffer("attention_bias_idxs", torch.tensor(indices).view(len(points), len(points)),
                             persistent=False)

    def forward(self, hidden_state):
        B, N, _ = hidden_state.shape
        q, k, v = self.qkv(hidden_state).view(B, N, self.num_heads, -1).split(
            [self.key_dim, self.key_dim, self.ratio * self.key_dim], dim=3)
        q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        biases = self.attention_biases[:, self.attention_bias_idxs]
        attention = q @ k.transpose(-2, -1) * self.scale
        if self.bug == "after_softmax":
            attention = attention.softmax(dim=-1) + biases
        else:
            attention = (attention + biases).softmax(dim=-1)
        out = (attention @ v).transpose(1, 2).reshape(B, N, self.out_dim)
        return self.projection(self.activation(out))
