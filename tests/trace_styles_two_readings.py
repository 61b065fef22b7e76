"""A cross-attention with two parameters that each raise on trace's first guess, the mask unpacked before the other
is read, in the style of transformers' ConditionalDetrDecoderCrossAttention (models/conditional_detr): its encoder
mask taken as `[bsz, src_len]` at the top of the forward (`_prepare_4d_attention_mask`), its query sine embedding
`[n_batch, n_Q, d]` viewed per head with the queries' shape and joined to each head's content query; keys join
their projected positions the same way, so q and k are twice the values' head width."""

from __future__ import annotations

import torch
from torch import nn


class SineJoinedCrossAttention(nn.Module):
    def __init__(self, hidden_size: int = 32, num_attention_heads: int = 4, bug: str | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_attention_heads, hidden_size // num_attention_heads, bug
        self.q_content_proj = nn.Linear(hidden_size, hidden_size)
        self.k_content_proj = nn.Linear(hidden_size, hidden_size)
        self.k_pos_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.q_pos_sine_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)
        self.scaling = (2 * self.head_dim) ** -0.5

    def forward(self, hidden_states, encoder_hidden_states, query_sine_embed, encoder_position_embeddings,
                encoder_attention_mask=None):
        bsz, tgt_len, _ = hidden_states.shape
        bias = None
        if encoder_attention_mask is not None:
            batch, src_len = encoder_attention_mask.size()
            expanded = encoder_attention_mask[:, None, None, :].expand(batch, 1, tgt_len, src_len).to(
                hidden_states.dtype)
            inverted = expanded if self.bug == "mask_inverted" else 1.0 - expanded
            bias = inverted.masked_fill(inverted.to(torch.bool), torch.finfo(hidden_states.dtype).min)
        src = encoder_hidden_states.shape[1]
        query = self.q_content_proj(hidden_states).view(bsz, tgt_len, self.num_heads, self.head_dim)
        sine = self.q_pos_sine_proj(query_sine_embed).view(bsz, tgt_len, self.num_heads, self.head_dim)
        key = self.k_content_proj(encoder_hidden_states).view(bsz, src, self.num_heads, self.head_dim)
        key_pos = self.k_pos_proj(encoder_position_embeddings).view(bsz, src, self.num_heads, self.head_dim)
        value = self.v_proj(encoder_hidden_states).view(bsz, src, self.num_heads, self.head_dim).transpose(1, 2)
        query = torch.cat([query, sine], dim=-1).transpose(1, 2)
        key = torch.cat([key, key_pos], dim=-1).transpose(1, 2)
        scores = torch.matmul(query, key.transpose(2, 3)) * self.scaling
        if bias is not None:
            scores = scores + bias
        weights = nn.functional.softmax(scores, dim=-2 if self.bug == "softmax_queries" else -1)
        out = torch.matmul(weights, value).transpose(1, 2).reshape(bsz, tgt_len, -1)
        return self.o_proj(out), weights
