"""Transformer-XL's relative attention as transformers' ParakeetEncoderAttention writes it (models/parakeet): q_proj,
k_proj, v_proj and o_proj beside `relative_k_proj`, a projection of the position embeddings whose name holds a key's
word; the content bias `bias_u` added to the queries against the keys and the position bias `bias_v` against the
projected positions, that term scaled and masked and handed to the attention as its additive mask. Here the
positions are one embedding per key, `[n_batch, n_K, d]` (Parakeet's relative shift left out). Plant `kv_swapped`."""

from __future__ import annotations

import torch
from torch import nn


class RelativeKeyAttention(nn.Module):
    def __init__(self, hidden_size: int = 32, num_heads: int = 4, bug: str | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)
        self.relative_k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.bias_u = nn.Parameter(0.1 * torch.randn(num_heads, self.head_dim))
        self.bias_v = nn.Parameter(0.1 * torch.randn(num_heads, self.head_dim))

    def forward(self, hidden_states: torch.Tensor, position_embeddings: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """attention_mask: `[batch, 1, time, time]`, True for keys that are not masked."""
        b, n, _ = hidden_states.shape
        shape = (b, n, self.num_heads, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if self.bug == "kv_swapped":
            key, value = value, key
        relative = self.relative_k_proj(position_embeddings).view(b, -1, self.num_heads, self.head_dim)
        matrix_bd = (query + self.bias_v[None, :, None]) @ relative.permute(0, 2, 3, 1) * self.scaling
        if attention_mask is not None:
            matrix_bd = matrix_bd.masked_fill(attention_mask.logical_not(), torch.finfo(matrix_bd.dtype).min)
        scores = (query + self.bias_u[None, :, None]) @ key.transpose(2, 3) * self.scaling + matrix_bd
        out = torch.softmax(scores, dim=-1) @ value
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))
