"""Attention whose queries' and keys' projections read the input plus a position embedding, the values' the input
alone, in the forms real code writes it (tests/test_trace_r12_detr.py checks each against transformers' eager DETR
attention or SDPA, and each plant against the correct form):

- DetrQuerySelf, DetrQueryCross: transformers 5's DetrSelfAttention / DetrCrossAttention as DetrDecoderLayer calls
  them: `query_key_input = hidden_states + position_embeddings`, 4-D matmuls, `* scaling` on the scores; the
  object queries' position an nn.Embedding of the decoder's, the memory's a sine embedding of its positions;
- DetrBmm: transformers 4.4x's DetrAttention, `object_queries` a forward argument, q scaled after q_proj, heads folded
  into the batch (`view(bsz * num_heads, -1, head_dim)`, bmm), its 4-D additive mask [bsz, 1, tgt, src] added on a
  view [bsz, num_heads, tgt, src];
- TwoWayCross: SAM's TwoWayAttentionBlock token-to-image step, `q = queries + query_pe; k = keys + key_pe;
  attn(q=q, k=k, v=keys)`, its Attention's `_separate_heads` / `q @ k.permute(0, 1, 3, 2)` / `/ math.sqrt(c)`;
- PosParamAttention: weights as nn.Parameters (`x @ W`), the position a forward argument, SDPA;
- DetrEncoderSelf: facebookresearch/detr's TransformerEncoderLayer, `q = k = self.with_pos_embed(src, pos)`,
  `self.self_attn(q, k, value=src, key_padding_mask=...)`, an nn.MultiheadAttention on time-first inputs.
`bug=` plants one mistake: values_from_keys, scale_twice, dropout_left_on, mask_multiplied, softmax_axis.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


def _moved(module, seed):
    """Weights moved off their init (a trained look)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return module


def sine_positions(n, d, dtype):
    """DETR's sine position embedding, one axis: [n, d]."""
    position = torch.arange(n, dtype=dtype)[:, None]
    inv = 10000 ** (torch.arange(0, d, 2, dtype=dtype) / d)
    angle = position / inv
    return torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(-2)


class DetrQuerySelf(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4, num_queries=16, dropout=0.0, bug=None):
        super().__init__()
        self.head_dim = hidden_size // num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = dropout
        self.bug = bug
        self.query_position_embeddings = nn.Embedding(num_queries, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)
        _moved(self, 1)

    def forward(self, hidden_states, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        position_embeddings = self.query_position_embeddings.weight[: input_shape[1]].unsqueeze(0)
        query_key_input = hidden_states + position_embeddings
        query_states = self.q_proj(query_key_input).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(query_key_input).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.bug == "values_from_keys":
            value_states = key_states
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if self.bug == "scale_twice":
            attn_weights = attn_weights * self.scaling
        if attention_mask is not None:
            if self.bug == "mask_multiplied":
                attn_weights = attn_weights * attention_mask
            else:
                attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        if self.bug == "dropout_left_on":
            attn_weights = F.dropout(attn_weights, p=self.attention_dropout)
        else:
            attn_weights = F.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class DetrQueryCross(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4, num_queries=16, bug=None):
        super().__init__()
        self.head_dim = hidden_size // num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.bug = bug
        self.query_position_embeddings = nn.Embedding(num_queries, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)
        _moved(self, 2)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask=None):
        query_input_shape = hidden_states.shape[:-1]
        kv_input_shape = encoder_hidden_states.shape[:-1]
        position_embeddings = self.query_position_embeddings.weight[: query_input_shape[1]].unsqueeze(0)
        encoder_position_embeddings = sine_positions(kv_input_shape[1], hidden_states.shape[-1], hidden_states.dtype)
        query_input = hidden_states + position_embeddings
        key_input = encoder_hidden_states + encoder_position_embeddings
        query_states = self.q_proj(query_input).view(*query_input_shape, -1, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(key_input).view(*kv_input_shape, -1, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(encoder_hidden_states).view(*kv_input_shape, -1, self.head_dim).transpose(1, 2)
        if self.bug == "values_from_keys":
            value_states = key_states
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if encoder_attention_mask is not None:
            attn_weights = attn_weights + encoder_attention_mask
        attn_weights = F.softmax(attn_weights, dim=-2 if self.bug == "softmax_axis" else -1)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        return self.o_proj(attn_output.reshape(*query_input_shape, -1))


class DetrBmm(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, dropout=0.0, bias=True, bug=None):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.bug = bug
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        _moved(self, 3)

    def _shape(self, tensor, seq_len, batch_size):
        return tensor.view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask=None, object_queries=None):
        batch_size, target_len, embed_dim = hidden_states.size()
        hidden_states_original = hidden_states
        if object_queries is not None:
            hidden_states = hidden_states + object_queries
        query_states = self.q_proj(hidden_states) * self.scaling
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
        if self.bug == "scale_twice":
            attn_weights = attn_weights * self.scaling
        if attention_mask is not None:
            if attention_mask.size() != (batch_size, 1, target_len, source_len):
                raise ValueError(f"Attention mask should be of size {(batch_size, 1, target_len, source_len)}, but "
                                 f"is {attention_mask.size()}")
            viewed = attn_weights.view(batch_size, self.num_heads, target_len, source_len)
            viewed = viewed * attention_mask if self.bug == "mask_multiplied" else viewed + attention_mask
            attn_weights = viewed.view(batch_size * self.num_heads, target_len, source_len)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_probs = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = torch.bmm(attn_probs, value_states)
        attn_output = attn_output.view(batch_size, self.num_heads, target_len, self.head_dim).transpose(1, 2)
        return self.out_proj(attn_output.reshape(batch_size, target_len, embed_dim))


class SamAttention(nn.Module):
    def __init__(self, embedding_dim, num_heads, bug=None):
        super().__init__()
        self.num_heads = num_heads
        self.bug = bug
        self.q_proj = nn.Linear(embedding_dim, embedding_dim)
        self.k_proj = nn.Linear(embedding_dim, embedding_dim)
        self.v_proj = nn.Linear(embedding_dim, embedding_dim)
        self.out_proj = nn.Linear(embedding_dim, embedding_dim)

    def _separate_heads(self, x, num_heads):
        b, n, c = x.shape
        return x.reshape(b, n, num_heads, c // num_heads).transpose(1, 2)

    def _recombine_heads(self, x):
        b, n_heads, n_tokens, c_per_head = x.shape
        return x.transpose(1, 2).reshape(b, n_tokens, n_heads * c_per_head)

    def forward(self, q, k, v):
        q = self._separate_heads(self.q_proj(q), self.num_heads)
        k = self._separate_heads(self.k_proj(k), self.num_heads)
        v = self._separate_heads(self.v_proj(v), self.num_heads)
        _, _, _, c_per_head = q.shape
        attn = q @ k.permute(0, 1, 3, 2)
        attn = attn / math.sqrt(c_per_head)
        if self.bug == "scale_twice":
            attn = attn / math.sqrt(c_per_head)
        attn = torch.softmax(attn, dim=-2 if self.bug == "softmax_axis" else -1)
        return self.out_proj(self._recombine_heads(attn @ v))


class TwoWayCross(nn.Module):
    def __init__(self, embedding_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.cross_attn_token_to_image = SamAttention(embedding_dim, num_heads, bug=bug)
        _moved(self, 4)

    def forward(self, queries, keys, query_pe, key_pe):
        q = queries + query_pe
        k = keys + key_pe
        return self.cross_attn_token_to_image(q=q, k=k, v=keys)


class PosParamAttention(nn.Module):
    def __init__(self, d_model=32, n_heads=4, bug=None):
        super().__init__()
        self.n_heads = n_heads
        self.bug = bug
        self.W_q = nn.Parameter(torch.randn(d_model, d_model) / math.sqrt(d_model))
        self.W_k = nn.Parameter(torch.randn(d_model, d_model) / math.sqrt(d_model))
        self.W_v = nn.Parameter(torch.randn(d_model, d_model) / math.sqrt(d_model))
        self.W_o = nn.Parameter(torch.randn(d_model, d_model) / math.sqrt(d_model))
        _moved(self, 5)

    def forward(self, x, query_pos, mask=None):
        b, n, d = x.shape
        with_pos = x + query_pos
        q = (with_pos @ self.W_q).view(b, n, self.n_heads, -1).permute(0, 2, 1, 3)
        k = (with_pos @ self.W_k).view(b, n, self.n_heads, -1).permute(0, 2, 1, 3)
        v = (x @ self.W_v).view(b, n, self.n_heads, -1).permute(0, 2, 1, 3)
        if self.bug == "values_from_keys":
            v = k
        if self.bug == "scale_twice":
            q = q / math.sqrt(q.shape[-1])
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return y.permute(0, 2, 1, 3).reshape(b, n, d) @ self.W_o


class DetrEncoderSelf(nn.Module):
    def __init__(self, d_model=32, nhead=4, dropout=0.0):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        _moved(self, 6)

    def with_pos_embed(self, tensor, pos):
        return tensor if pos is None else tensor + pos

    def forward(self, src, src_mask=None, src_key_padding_mask=None, pos=None):
        q = k = self.with_pos_embed(src, pos)
        return self.self_attn(q, k, value=src, attn_mask=src_mask, key_padding_mask=src_key_padding_mask)[0]
