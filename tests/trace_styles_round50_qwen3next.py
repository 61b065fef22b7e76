"""Qwen3-Next gated attention as transformers writes it (modeling_qwen3_next.py, Qwen3NextAttention, eager path
written out): q_proj twice as wide, each head's queries beside its output gate ([.., n_head, 2 * head_dim]
chunked), zero-centred RMSNorm (1 + weight) on each head's q and k before RoPE, partial RoPE
(partial_rotary_factor = 0.25, half-split on the first quarter of each head), grouped-query heads,
additive 4-D causal mask, the merged heads multiplied by sigmoid(gate) before o_proj."""
import torch
from torch import nn


class Qwen3NextRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class Qwen3NextRotaryEmbedding(nn.Module):
    def __init__(self, head_dim, partial_rotary_factor=0.25, rope_theta=10000.0):
        super().__init__()
        dim = int(head_dim * partial_rotary_factor)
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class Qwen3NextAttention(nn.Module):
    def __init__(self, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 partial_rotary_factor=0.25, rope_theta=10000.0, rms_norm_eps=1e-6, bug=None):
        super().__init__()
        self.bug = bug
        self.head_dim = head_dim
        self.num_key_value_groups = num_attention_heads // num_key_value_heads
        if bug == "scale_2hd":
            # head size read off the query projection, which also holds the gate
            self.scaling = (self.head_dim * 2) ** -0.5
        else:
            self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.q_proj = nn.Linear(hidden_size, num_attention_heads * self.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_attention_heads * self.head_dim, hidden_size, bias=False)
        self.q_norm = Qwen3NextRMSNorm(self.head_dim, eps=rms_norm_eps)  # unlike olmo, only on the head dim!
        self.k_norm = Qwen3NextRMSNorm(self.head_dim, eps=rms_norm_eps)
        self.rotary_emb = Qwen3NextRotaryEmbedding(self.head_dim, partial_rotary_factor, rope_theta)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states, gate = torch.chunk(
            self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1
        )
        gate = gate.reshape(*input_shape, -1)

        if self.bug == "no_q_norm":
            query_states = query_states.reshape(hidden_shape).transpose(1, 2)
        elif self.bug == "norm_after_rope":
            query_states = query_states.reshape(hidden_shape).transpose(1, 2)
        else:
            query_states = self.q_norm(query_states.view(hidden_shape)).transpose(1, 2)
        if self.bug == "norm_after_rope":
            key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        else:
            key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        if self.bug == "v_normed":
            value_states = self.k_norm(self.v_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        else:
            value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        if position_ids is None:
            position_ids = torch.arange(input_shape[1], device=hidden_states.device)[None]
        cos, sin = self.rotary_emb(value_states, position_ids)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if self.bug == "norm_after_rope":
            query_states = self.q_norm(query_states)
            key_states = self.k_norm(key_states)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
            attn_weights = attn_weights + causal_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous()

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = attn_output * torch.sigmoid(gate)

        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights
