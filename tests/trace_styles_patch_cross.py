"""A cross-attention of patches over bytes in the style of the Byte Latent Transformer's local encoder
(transformers' models/blt: BltCrossAttention): each patch query sees the bytes of its own patch only, the code adding
its `[n_batch, n_Q, n_K]` additive mask to scores `[n_batch, n_head, n_Q, n_K]` as it stands (so that it raises
on it, and trace lays it out as the scores are), with as many heads as patches. Plant `kv_swapped`."""

from __future__ import annotations

import torch
from torch import nn


class PatchCrossAttention(nn.Module):
    def __init__(self, hidden_size: int = 32, num_heads: int = 4, bug: str | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, cross_attention_states, attention_mask=None):
        b, n_q, _ = hidden_states.shape
        n_k = cross_attention_states.shape[1]
        query = self.q_proj(hidden_states).view(b, n_q, self.num_heads, -1).transpose(1, 2)
        key = self.k_proj(cross_attention_states).view(b, n_k, self.num_heads, -1).transpose(1, 2)
        value = self.v_proj(cross_attention_states).view(b, n_k, self.num_heads, -1).transpose(1, 2)
        if self.bug == "kv_swapped":
            key, value = value, key
        attn_weights = torch.matmul(query, key.transpose(2, 3)) * self.head_dim ** -0.5
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        out = torch.matmul(attn_weights, value).transpose(1, 2).reshape(b, n_q, -1)
        return self.o_proj(out)
