"""Code that takes its mask in more than one form and branches on the mask's rank, so that a form trace does not hand
first runs other code: a Pix2Struct-like vision attention (HF's pre-4.50 Pix2StructVisionAttention, T5's
`position_bias` made from the mask, with a branch for a 2-D mask beside the 4-D one); a BERT-like self-attention that
extends its own mask (get_extended_attention_mask: a 2-D and a 3-D branch, any other rank refused); a diffusers-like
attention whose 2-D key padding is made a bias [batch, 1, key] by the code (Transformer2DModel's), a 3-D mask taken
as a bias as it is, both through prepare_attention_mask's `repeat_interleave` over the heads and `baddbmm`.
Plants: a branch trace's first form never reaches (Pix2Struct's 2-D branch on the queries, BERT's 3-D branch read
transposed), and ones every form reaches (the scale, the heads merged without their transpose).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from _trace_ref import trained


class Pix2StructVisionLike(nn.Module):
    """HF Pix2Struct's vision attention before the attention interface: unscaled scores, no biases, T5's
    position bias made from the mask."""

    def __init__(self, hidden_size=32, num_attention_heads=4, d_kv=8, bug=None):
        super().__init__()
        self.n_heads, self.key_value_proj_dim, self.bug = num_attention_heads, d_kv, bug
        self.inner_dim = num_attention_heads * d_kv
        self.query = nn.Linear(hidden_size, self.inner_dim, bias=False)
        self.key = nn.Linear(hidden_size, self.inner_dim, bias=False)
        self.value = nn.Linear(hidden_size, self.inner_dim, bias=False)
        self.output = nn.Linear(self.inner_dim, hidden_size, bias=False)
        trained(self, 29)

    def forward(self, hidden_states, attention_mask=None, position_bias=None, layer_head_mask=None):
        batch_size, seq_length = hidden_states.shape[:2]

        def to_projection_shape(states):
            return states.contiguous().view(batch_size, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)

        query_states = to_projection_shape(self.query(hidden_states))  # [n_batch, n_head, n_Q, d_head]
        key_states = to_projection_shape(self.key(hidden_states))
        value_states = to_projection_shape(self.value(hidden_states))
        scores = torch.matmul(query_states, key_states.transpose(3, 2))  # [n_batch, n_head, n_Q, n_K]
        if self.bug == "scaled":
            scores = scores / math.sqrt(self.key_value_proj_dim)
        if position_bias is None:
            position_bias = torch.zeros((1, self.n_heads, seq_length, seq_length), dtype=scores.dtype)
            if attention_mask is None:
                attention_mask = torch.ones((batch_size, seq_length), dtype=scores.dtype)
            if attention_mask.dim() == 2:
                if self.bug == "mask_on_queries":
                    position_bias = position_bias + attention_mask[:, None, :, None]
                else:
                    position_bias = position_bias + attention_mask[:, None, None, :]
            else:
                # (batch_size, n_heads, seq_length, key_length)
                position_bias = position_bias + attention_mask
            position_bias = 1 - position_bias
        position_bias_masked = position_bias.masked_fill(position_bias == 1, torch.finfo(scores.dtype).min)
        scores += position_bias_masked
        scores = torch.max(scores, torch.tensor(torch.finfo(scores.dtype).min))
        attn_weights = F.softmax(scores, dim=-1, dtype=torch.float32).type_as(scores)
        if layer_head_mask is not None:
            attn_weights = attn_weights * layer_head_mask
        attn_output = torch.matmul(attn_weights, value_states)  # [n_batch, n_head, n_Q, d_head]
        if self.bug == "merge_no_transpose":
            attn_output = attn_output.contiguous().view(batch_size, -1, self.inner_dim)
        else:
            attn_output = attn_output.transpose(1, 2).contiguous().view(batch_size, -1, self.inner_dim)
        return self.output(attn_output), position_bias


class BertExtendingSelfAttention(nn.Module):
    """BERT-like self-attention taking the 0/1 mask its model would take (2-D key padding or a 3-D mask per
    query) and extending it itself, as ModuleUtilsMixin.get_extended_attention_mask does."""

    def __init__(self, hidden_size=24, num_attention_heads=3, bug=None):
        super().__init__()
        self.num_attention_heads, self.bug = num_attention_heads, bug
        self.attention_head_size = hidden_size // num_attention_heads
        self.all_head_size = hidden_size
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        trained(self, 29)

    def get_extended_attention_mask(self, attention_mask, dtype):
        if attention_mask.dim() == 3:
            if self.bug == "mask3d_transposed":
                extended_attention_mask = attention_mask.transpose(-1, -2)[:, None, :, :]
            else:
                extended_attention_mask = attention_mask[:, None, :, :]
        elif attention_mask.dim() == 2:
            extended_attention_mask = attention_mask[:, None, None, :]
        else:
            raise ValueError(f"Wrong shape for attention_mask (shape {attention_mask.shape})")
        extended_attention_mask = extended_attention_mask.to(dtype=dtype)
        return (1.0 - extended_attention_mask) * torch.finfo(dtype).min

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)  # [n_batch, n_head, n, d_head]

    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))  # [n_batch, n_head, n_Q, n_K]
        if self.bug != "no_scale":
            attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + self.get_extended_attention_mask(attention_mask, hidden_states.dtype)
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer)  # [n_batch, n_head, n_Q, d_head]
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        context_layer = context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))
        return self.dense(context_layer)


class DiffusersLikeAttention(nn.Module):
    """diffusers' Attention with AttnProcessor (baddbmm scores, heads folded into the batch); a 2-D key padding
    [batch, key] (1 = keep) made a bias [batch, 1, key] first, a 3-D mask taken as a bias as it is."""

    def __init__(self, query_dim=24, heads=3, dim_head=8, bug=None):
        super().__init__()
        inner_dim = heads * dim_head
        self.heads, self.scale, self.bug = heads, dim_head ** -0.5, bug
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner_dim, query_dim), nn.Dropout(0.0)])
        trained(self, 29)

    def prepare_attention_mask(self, attention_mask, target_length, batch_size):
        head_size = self.heads
        if attention_mask is None:
            return attention_mask
        if attention_mask.shape[0] < batch_size * head_size:
            attention_mask = attention_mask.repeat_interleave(head_size, dim=0)
        return attention_mask

    def head_to_batch_dim(self, tensor):
        batch_size, seq_len, dim = tensor.shape
        tensor = tensor.reshape(batch_size, seq_len, self.heads, dim // self.heads).permute(0, 2, 1, 3)
        return tensor.reshape(batch_size * self.heads, seq_len, dim // self.heads)  # [n_batch·n_head, n, d_head]

    def batch_to_head_dim(self, tensor):
        batch_size, seq_len, dim = tensor.shape
        tensor = tensor.reshape(batch_size // self.heads, self.heads, seq_len, dim)
        if self.bug == "merge_no_transpose":
            return tensor.reshape(batch_size // self.heads, seq_len, dim * self.heads)
        return tensor.permute(0, 2, 1, 3).reshape(batch_size // self.heads, seq_len, dim * self.heads)

    def forward(self, hidden_states, attention_mask=None):
        if attention_mask is not None and attention_mask.ndim == 2:
            # (batch, key_tokens) 1 = keep -> a bias (batch, 1, key_tokens)
            attention_mask = (1 - attention_mask.to(hidden_states.dtype)) * -10000.0
            attention_mask = attention_mask.unsqueeze(2 if self.bug == "mask2d_on_queries" else 1)
        batch_size, sequence_length, _ = hidden_states.shape
        attention_mask = self.prepare_attention_mask(attention_mask, sequence_length, batch_size)
        query = self.head_to_batch_dim(self.to_q(hidden_states))
        key = self.head_to_batch_dim(self.to_k(hidden_states))
        value = self.head_to_batch_dim(self.to_v(hidden_states))
        scale = 1.0 if self.bug == "no_scale" else self.scale
        if attention_mask is None:
            baddbmm_input = torch.empty(query.shape[0], query.shape[1], key.shape[1], dtype=query.dtype)
            beta = 0
        else:
            baddbmm_input, beta = attention_mask, 1
        attention_scores = torch.baddbmm(baddbmm_input, query, key.transpose(-1, -2), beta=beta, alpha=scale)
        attention_probs = attention_scores.softmax(dim=-1)
        hidden_states = self.batch_to_head_dim(torch.bmm(attention_probs, value))  # [n_batch, n, n_head·d_head]
        hidden_states = self.to_out[0](hidden_states)
        return self.to_out[1](hidden_states)
