"""Idefics' gated cross-attention as transformers 4.3x wrote it (IdeficsAttention with qk_layer_norms): text
queries over image keys of another width, each head's q and k RMS-normed (IdeficsRMSNorm: the variance in float32,
then `weight *`), F.scaled_dot_product_attention with the image mask turned into a bias.

Plant (bug=...): 'keys_from_values' (`key_states = self.v_proj(key_value_states)`, then k's norm on it)."""

import torch
from torch import nn


class IdeficsRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class IdeficsCrossAttention(nn.Module):
    def __init__(self, hidden_size=32, kv_input_dim=48, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.hidden_size = num_heads, hidden_size // num_heads, hidden_size
        self.bug = bug
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(kv_input_dim, hidden_size, bias=False)
        self.v_proj = nn.Linear(kv_input_dim, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.q_layer_norm = IdeficsRMSNorm(self.head_dim)
        self.k_layer_norm = IdeficsRMSNorm(self.head_dim)

    def forward(self, hidden_states, key_value_states, image_attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        kv_len = key_value_states.shape[1]
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        keys_from = self.v_proj if self.bug == "keys_from_values" else self.k_proj
        key_states = keys_from(key_value_states).view(bsz, kv_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(key_value_states).view(bsz, kv_len, self.num_heads, self.head_dim).transpose(1, 2)
        query_states = self.q_layer_norm(query_states)
        key_states = self.k_layer_norm(key_states)
        bias = None
        if image_attention_mask is not None:  # 1 = an image token, 0 = none: invert_attention_mask
            bias = (1.0 - image_attention_mask[:, None, None, :].to(query_states.dtype)) * torch.finfo(
                query_states.dtype).min
        attn_output = nn.functional.scaled_dot_product_attention(query_states, key_states, value_states,
                                                                 attn_mask=bias)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)
