"""Styles for tests/test_trace_round33_keras.py (held-out round 33): Keras 3's MultiHeadAttention ported line by
line (EinsumDense kernels [d_model, n_head, d_head] named `_query_dense`, `_key_dense`, `_value_dense`,
`_output_dense`; a 0/1 `attention_mask` turned into a bias, its polarity stated in a comment at the top of the
helper that applies it), and transformers' CLIPAttention as written before the attention interface (a
`causal_attention_mask` and an `attention_mask`, both additive, heads folded into bmm). `bug=` plants a mistake."""

from __future__ import annotations

import math

import torch
from torch import nn


def _moved(module: nn.Module, seed: int) -> None:
    """Every weight off its initial value (trained-looking: no zero bias, no unit gain)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


class EinsumDense(nn.Module):
    def __init__(self, equation, kernel_shape, bias_shape):
        super().__init__()
        self.equation = equation
        self.kernel = nn.Parameter(torch.randn(*kernel_shape) * 0.25)
        self.bias = nn.Parameter(torch.zeros(*bias_shape))

    def forward(self, inputs):
        return torch.einsum(self.equation, inputs, self.kernel) + self.bias


class KerasMultiHeadAttention(nn.Module):
    """`forward(query, value=None, key=None, attention_mask=None)`; 'kv_swapped' scores the values and weighs the
    keys, 'mask_polarity' builds the bias as `mask * -1e9`."""

    def __init__(self, num_heads=4, key_dim=8, model_dim=32, bug=None):
        super().__init__()
        self.bug = bug
        self._key_dim = key_dim
        self._query_dense = EinsumDense("abc,cde->abde", (model_dim, num_heads, key_dim), (num_heads, key_dim))
        self._key_dense = EinsumDense("abc,cde->abde", (model_dim, num_heads, key_dim), (num_heads, key_dim))
        self._value_dense = EinsumDense("abc,cde->abde", (model_dim, num_heads, key_dim), (num_heads, key_dim))
        self._output_dense = EinsumDense("abcd,cde->abe", (num_heads, key_dim, model_dim), (model_dim,))
        self._inverse_sqrt_key_dim = 1.0 / math.sqrt(float(key_dim))
        _moved(self, 33)

    def _masked_softmax(self, attention_scores, attention_mask=None):
        # attention_scores: [B, N, T, S]; attention_mask: [B, T, S], 1 = attend
        if attention_mask is not None:
            mask = attention_mask.unsqueeze(-3).to(attention_scores.dtype)
            bias = mask * -1e9 if self.bug == "mask_polarity" else (1.0 - mask) * -1e9
            attention_scores = attention_scores + bias
        return torch.softmax(attention_scores, dim=-1)

    def _compute_attention(self, query, key, value, attention_mask=None):
        query = query * self._inverse_sqrt_key_dim
        if self.bug == "kv_swapped":
            key, value = value, key
        attention_scores = torch.einsum("aecd,abcd->acbe", key, query)
        attention_scores = self._masked_softmax(attention_scores, attention_mask)
        return torch.einsum("acbe,aecd->abcd", attention_scores, value)

    def forward(self, query, value=None, key=None, attention_mask=None):
        value = query if value is None else value
        key = value if key is None else key
        query, key, value = self._query_dense(query), self._key_dense(key), self._value_dense(value)
        return self._output_dense(self._compute_attention(query, key, value, attention_mask))


class CLIPLike(nn.Module):
    """CLIPAttention (text tower) before the attention interface; 'causal_after_softmax' multiplies the weights by
    `(causal_attention_mask == 0)` after the softmax instead of adding the mask before it."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.bug, self.embed_dim, self.num_heads = bug, embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        _moved(self, 34)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask=None, causal_attention_mask=None, output_attentions=False):
        bsz, tgt_len, embed_dim = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scale
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if causal_attention_mask is not None and self.bug != "causal_after_softmax":
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + causal_attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        if causal_attention_mask is not None and self.bug == "causal_after_softmax":
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) * (causal_attention_mask == 0)
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        return self.out_proj(attn_output.reshape(bsz, tgt_len, embed_dim)), None
