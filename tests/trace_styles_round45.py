"""Styles for tests/test_trace_round45.py, from held-out round 45. KosmosLike is transformers' 4.3x Kosmos-2
`KosmosTextAttention` as a port that dropped head masking writes it: q scaled before the product, the model's 4-D
additive mask `[n_batch, 1, n_Q, n_K]` added, a LayerNorm on the merged heads (`inner_attn_ln`), and
`layer_head_mask` kept in the signature but never read. `bug='scaled_twice'` scales the scores again
(scale.twice)."""

from __future__ import annotations

import torch
from torch import nn


def _moved(module: nn.Module, seed: int) -> None:
    """Every weight off its initial value (trained-looking: no unit norm, no zero bias)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


class KosmosLike(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.bug = embed_dim, num_heads, bug
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.inner_attn_ln = nn.LayerNorm(embed_dim, eps=1e-5)
        _moved(self, 451)

    def _shape(self, projection):
        return projection.view(projection.size(0), -1, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, layer_head_mask=None,
                output_attentions=False):
        batch_size, seq_length = hidden_states.shape[:2]
        current_states = encoder_hidden_states if encoder_hidden_states is not None else hidden_states
        key_states = self._shape(self.k_proj(current_states))
        value_states = self._shape(self.v_proj(current_states))
        query_states = self._shape(self.q_proj(hidden_states) * self.scaling)
        attn_weights = torch.matmul(query_states, key_states.transpose(-1, -2))
        if self.bug == "scaled_twice":
            attn_weights = attn_weights * self.scaling
        src_len = key_states.size(2)
        if attention_mask is not None:
            if attention_mask.size() != (batch_size, 1, seq_length, src_len):
                raise ValueError(f"Attention mask should be of size {(batch_size, 1, seq_length, src_len)}")
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        context_states = torch.matmul(attn_weights, value_states)
        context_states = context_states.permute(0, 2, 1, 3).contiguous().view(batch_size, seq_length, -1)
        context_states = self.inner_attn_ln(context_states)
        return self.out_proj(context_states), attn_weights
