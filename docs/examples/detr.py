"""Attention whose queries' and keys' projections read x plus a position embedding, the values' x alone (docs/trace.md,
"DETR and SAM: a position embedding on the queries and keys"): transformers 4.4x's DetrAttention, shrunk, its
position embeddings forward arguments (`object_queries`, `spatial_position_embeddings` for cross-attention's
memory), heads folded into the batch for bmm, its 4-D additive mask [bsz, 1, tgt, src] added on a view; a `bug`.
pad_2x9.npy is key padding [n_batch=2, n_K=9], True = may attend."""

import torch
from torch import nn


class DetrAttention(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, dropout=0.0, bug=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.dropout, self.bug = embed_dim, num_heads, dropout, bug
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        with torch.no_grad():  # weights moved off their init (a trained look)
            g = torch.Generator().manual_seed(0)
            for p in self.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.3)

    def _shape(self, tensor, seq_len, batch_size):
        return tensor.view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def with_pos_embed(self, tensor, object_queries):
        return tensor if object_queries is None else tensor + object_queries

    def forward(self, hidden_states, attention_mask=None, object_queries=None, key_value_states=None,
                spatial_position_embeddings=None):
        is_cross_attention = key_value_states is not None
        batch_size, target_len, embed_dim = hidden_states.size()
        hidden_states_original = hidden_states
        hidden_states = self.with_pos_embed(hidden_states, object_queries)
        if is_cross_attention:
            key_value_states_original = key_value_states
            key_value_states = self.with_pos_embed(key_value_states, spatial_position_embeddings)
        query_states = self.q_proj(hidden_states) * self.scaling
        if is_cross_attention:
            key_states = self._shape(self.k_proj(key_value_states), -1, batch_size)
            value_states = self._shape(self.v_proj(key_value_states_original), -1, batch_size)
        else:
            key_states = self._shape(self.k_proj(hidden_states), -1, batch_size)
            value_states = self._shape(self.v_proj(hidden_states_original), -1, batch_size)
        if self.bug == "values_from_keys":
            value_states = key_states
        proj_shape = (batch_size * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, target_len, batch_size).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)
        source_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            if attention_mask.size() != (batch_size, 1, target_len, source_len):
                raise ValueError(f"Attention mask should be of size {(batch_size, 1, target_len, source_len)}, but "
                                 f"is {attention_mask.size()}")
            attn_weights = attn_weights.view(batch_size, self.num_heads, target_len, source_len) + attention_mask
            attn_weights = attn_weights.view(batch_size * self.num_heads, target_len, source_len)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_probs = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = torch.bmm(attn_probs, value_states)
        attn_output = attn_output.view(batch_size, self.num_heads, target_len, self.head_dim).transpose(1, 2)
        return self.out_proj(attn_output.reshape(batch_size, target_len, embed_dim))
