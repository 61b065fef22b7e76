"""OLMo 2's attention as transformers writes it: q_norm = Olmo2RMSNorm(num_heads * head_dim) and k_norm =
Olmo2RMSNorm(num_kv_heads * head_dim) applied to the whole projections before the head split (unlike OLMo-1's
clip, Qwen3's per-head norm), then view / transpose, rotate_half RoPE from position_embeddings (cos, sin),
grouped-query attention via repeat_kv in the eager path, additive mask, o_proj.

Bugs (bug=...):
  norm_per_head    the norms applied after the view, over each head's head_dim (weights viewed (heads, head_dim))
  norm_after_rope  q_norm / k_norm applied to the rotated heads, flattened back to the projection's width
  v_normed         value_states = self.k_norm(self.v_proj(hidden_states)) (copy of the key line)
  v_from_k         value_states = self.k_proj(hidden_states) (copy of the key line, projection not changed)
"""
from types import SimpleNamespace

import torch
from torch import nn


class Olmo2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        """
        Olmo2RMSNorm is equivalent to T5LayerNorm
        """
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states, per_head=False):
        input_dtype = hidden_states.dtype
        if input_dtype != torch.float64:
            hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        weight = self.weight.view(hidden_states.shape[-2:]) if per_head else self.weight
        return (weight * hidden_states).to(input_dtype)


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    q_type, k_type = q.dtype, k.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed.to(q_type), k_embed.to(k_type)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)

    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = attn_weights + causal_mask

    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()

    return attn_output, attn_weights


class Olmo2Attention(nn.Module):
    """Multi-headed attention from 'Attention Is All You Need' paper"""

    def __init__(self, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                 attention_dropout=0.0, attention_bias=False, layer_idx=0, bug=None):
        super().__init__()
        config = SimpleNamespace(
            hidden_size=hidden_size, num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
            rms_norm_eps=rms_norm_eps, attention_dropout=attention_dropout, attention_bias=attention_bias,
        )
        self.config = config
        self.bug = bug
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True

        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias
        )
        self.q_norm = Olmo2RMSNorm(config.num_attention_heads * self.head_dim, config.rms_norm_eps)
        self.k_norm = Olmo2RMSNorm(config.num_key_value_heads * self.head_dim, config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        if self.bug == "norm_per_head":
            query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape), per_head=True)
            key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape), per_head=True)
            value_states = self.v_proj(hidden_states)
        elif self.bug == "norm_after_rope":
            query_states = self.q_proj(hidden_states)
            key_states = self.k_proj(hidden_states)
            value_states = self.v_proj(hidden_states)
        elif self.bug == "v_normed":
            query_states = self.q_norm(self.q_proj(hidden_states))
            key_states = self.k_norm(self.k_proj(hidden_states))
            value_states = self.k_norm(self.v_proj(hidden_states))
        elif self.bug == "v_from_k":
            query_states = self.q_norm(self.q_proj(hidden_states))
            key_states = self.k_norm(self.k_proj(hidden_states))
            value_states = self.k_proj(hidden_states)
        else:
            query_states = self.q_norm(self.q_proj(hidden_states))
            key_states = self.k_norm(self.k_proj(hidden_states))
            value_states = self.v_proj(hidden_states)

        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if self.bug == "norm_after_rope":
            query_states = self.q_norm(query_states.transpose(1, 2).flatten(2)).view(hidden_shape).transpose(1, 2)
            key_states = self.k_norm(key_states.transpose(1, 2).flatten(2)).view(hidden_shape).transpose(1, 2)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attn_output, attn_weights = eager_attention_forward(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights
