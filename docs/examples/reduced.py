"""Keys and values from a tensor the module makes from its input, as HF transformers' Segformer writes it, and
diffusers' Attention holding more qk-norms than its self-attention calls (docs/trace.md, "Segformer and PVT: keys
and values from a reduced sequence")."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class SegformerEfficientSelfAttention(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4, sequence_reduction_ratio=2):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.sr = nn.Conv2d(hidden_size, hidden_size, kernel_size=sequence_reduction_ratio,
                            stride=sequence_reduction_ratio)
        self.layer_norm = nn.LayerNorm(hidden_size)

    def transpose_for_scores(self, hidden_states):
        new_shape = hidden_states.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return hidden_states.view(new_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, height, width):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        batch_size, seq_len, num_channels = hidden_states.shape
        hidden_states = hidden_states.permute(0, 2, 1).reshape(batch_size, num_channels, height, width)
        hidden_states = self.sr(hidden_states).reshape(batch_size, num_channels, -1).permute(0, 2, 1)
        hidden_states = self.layer_norm(hidden_states)
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        attention_probs = attention_scores.softmax(dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3).contiguous()
        return context_layer.view(context_layer.size()[:-2] + (num_channels,))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim).uniform_(0.5, 1.5))  # gains as a trained checkpoint holds them

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return hidden_states.to(self.weight.dtype) * self.weight


class JointAttention(nn.Module):
    """diffusers' Attention of SD3: norm_added_q/k normalize a context that its self-attention never gets."""

    def __init__(self, query_dim=32, heads=4, dim_head=8):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(query_dim, inner) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(query_dim, inner) for _ in range(3))
        self.norm_q, self.norm_k = RMSNorm(dim_head), RMSNorm(dim_head)
        self.norm_added_q, self.norm_added_k = RMSNorm(dim_head), RMSNorm(dim_head)
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim), nn.Dropout(0.0)])

    def forward(self, hidden_states):
        b = hidden_states.shape[0]
        q, k, v = (f(hidden_states).view(b, -1, self.heads, 8).transpose(1, 2)
                   for f in (self.to_q, self.to_k, self.to_v))
        q, k = self.norm_q(q), self.norm_k(k)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, self.heads * 8)
        return self.to_out[1](self.to_out[0](out))


class GainAttention(nn.Module):
    """q and k normalized by F.rms_norm, then gained by parameters the attention module holds itself."""

    def __init__(self, dim=32, n_head=4):
        super().__init__()
        self.n_head, self.hd = n_head, dim // n_head
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))
        self.q_gain = nn.Parameter(torch.empty(self.hd).uniform_(0.5, 1.5))
        self.k_gain = nn.Parameter(torch.empty(self.hd).uniform_(0.5, 1.5))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (f(x).view(b, n, self.n_head, self.hd).transpose(1, 2) for f in (self.wq, self.wk, self.wv))
        q = F.rms_norm(q, (self.hd,), eps=1e-6) * self.q_gain
        k = F.rms_norm(k, (self.hd,), eps=1e-6) * self.k_gain
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, n, d))
