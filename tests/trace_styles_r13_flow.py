"""Styles for tests/test_trace_r13_flow.py, written the way their libraries write them, at tiny sizes.

qk-norms with learned gains, the module holding more norms than its self-attention calls:
- DiffusersNormed: diffusers' Attention (to_q/to_k/to_v, to_out ModuleList) with its RMSNorm (gain after the rsqrt,
  cast to the weight's dtype), norm_added_q/norm_added_k for a context never given; SDPA.
- T5Normed: T5LayerNorm-style norms (`self.weight * hidden_states`, variance_epsilon) named q_layernorm/k_layernorm,
  beside an unused context_layernorm; explicit matmul and softmax.
- ProjNormed: Mistral's RMSNorm over the whole projection (OLMo 2's placement), beside an unused one; SDPA.
- GainNormed: an F.rms_norm then `* self.gain` module (modded-nanogpt-like), beside an unused pair of them.
- LayerNormed: diffusers' qk_norm="layer_norm": nn.LayerNorm(d_head) with an affine gain and bias, and the added pair.

Keys and values read from a tensor the module makes from its input:
- ReducedSelfAttention: HF Segformer's efficient self-attention (LayerNorm(Conv2d(x as an image, stride sr))), no
  output projection, forward(hidden_states, height, width).
- PvtAttention: PVT v1's (q Linear, fused kv Linear over the reduced sequence, proj), `(q @ kᵀ) * scale`.
- PooledMemory: keys and values from an adaptive average pool over the sequence, to_q/to_k/to_v/to_out, SDPA.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return module


class DiffusersRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        hidden_states = hidden_states.to(self.weight.dtype) * self.weight
        return hidden_states.to(input_dtype)


class DiffusersNormed(nn.Module):
    def __init__(self, query_dim=32, heads=4, dim_head=8, bug=None):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.bug = heads, bug
        self.to_q = nn.Linear(query_dim, inner)
        self.to_k = nn.Linear(query_dim, inner)
        self.to_v = nn.Linear(query_dim, inner)
        self.norm_q = DiffusersRMSNorm(dim_head)
        self.norm_k = DiffusersRMSNorm(dim_head)
        self.add_q_proj = nn.Linear(query_dim, inner)
        self.add_k_proj = nn.Linear(query_dim, inner)
        self.add_v_proj = nn.Linear(query_dim, inner)
        self.norm_added_q = DiffusersRMSNorm(dim_head)
        self.norm_added_k = DiffusersRMSNorm(dim_head)
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim), nn.Dropout(0.0)])
        _trained(self)

    def forward(self, hidden_states):
        b = hidden_states.shape[0]
        query, key, value = self.to_q(hidden_states), self.to_k(hidden_states), self.to_v(hidden_states)
        head_dim = key.shape[-1] // self.heads
        if self.bug == "split_no_permute":
            query, key, value = (t.view(b, self.heads, -1, head_dim) for t in (query, key, value))
        else:
            query = query.view(b, -1, self.heads, head_dim).transpose(1, 2)
            key = key.view(b, -1, self.heads, head_dim).transpose(1, 2)
            value = value.view(b, -1, self.heads, head_dim).transpose(1, 2)
        query, key = self.norm_q(query), self.norm_k(key)
        if self.bug == "kv_swapped":
            out = F.scaled_dot_product_attention(query, value, key)
        else:
            out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.2 if self.bug == "dropout_on" else 0.0)
        out = out.transpose(1, 2).reshape(b, -1, self.heads * head_dim)
        return self.to_out[1](self.to_out[0](out))


class T5LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class T5Normed(nn.Module):
    def __init__(self, d_model=32, n_heads=4, bug=None):
        super().__init__()
        self.n_heads, self.d_kv, self.bug = n_heads, d_model // n_heads, bug
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.q_layernorm = T5LayerNorm(self.d_kv)
        self.k_layernorm = T5LayerNorm(self.d_kv)
        self.context_layernorm = T5LayerNorm(self.d_kv)  # for a memory this layer is never handed
        _trained(self, 1)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape

        def shape(states):
            return states.view(b, -1, self.n_heads, self.d_kv).transpose(1, 2)

        q = self.q_layernorm(shape(self.q(hidden_states)))
        k = self.k_layernorm(shape(self.k(hidden_states)))
        v = shape(self.v(hidden_states))
        scores = torch.matmul(q, k.transpose(3, 2)) / math.sqrt(self.d_kv)
        attn = F.softmax(scores.float(), dim=-2 if self.bug == "softmax_axis" else -1).type_as(scores)
        out = torch.matmul(attn, v).transpose(1, 2).contiguous().view(b, -1, self.n_heads * self.d_kv)
        return self.o(out)


class MistralRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class ProjNormed(nn.Module):
    """The norms over the whole projection, before the heads are split (OLMo 2's placement)."""

    def __init__(self, hidden_size=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.q_norm = MistralRMSNorm(hidden_size)
        self.k_norm = MistralRMSNorm(hidden_size)
        self.cross_norm = MistralRMSNorm(hidden_size)  # a cross-attention's, never called here
        _trained(self, 2)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        q = self.q_norm(self.q_proj(hidden_states))
        k = self.k_norm(self.k_proj(hidden_states))
        v = self.v_proj(hidden_states)
        if self.bug == "split_no_permute":
            q, k, v = (t.view(b, self.num_heads, n, self.head_dim) for t in (q, k, v))
        else:
            q, k, v = (t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        scale = 1 / math.sqrt(self.num_heads * self.head_dim) if self.bug == "scale_d_model" else None
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class GainNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),), eps=1e-6) * self.gain


class GainNormed(nn.Module):
    def __init__(self, dim=32, n_head=4, bug=None):
        super().__init__()
        self.n_head, self.head_dim, self.bug = n_head, dim // n_head, bug
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.qn, self.kn = GainNorm(self.head_dim), GainNorm(self.head_dim)
        self.memory_qn, self.memory_kn = GainNorm(self.head_dim), GainNorm(self.head_dim)  # unused here
        _trained(self, 3)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3 * self.n_head, self.head_dim).split(self.n_head, dim=2)
        q, k = self.qn(q), self.kn(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 if self.bug == "scale_none" else None)
        return self.proj(y.transpose(1, 2).contiguous().view(b, n, c))


class LayerNormed(nn.Module):
    """diffusers' Attention with qk_norm="layer_norm": an affine nn.LayerNorm over each head, gain and bias."""

    def __init__(self, query_dim=32, heads=4, dim_head=8, bug=None):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.bug = heads, bug
        self.to_q = nn.Linear(query_dim, inner)
        self.to_k = nn.Linear(query_dim, inner)
        self.to_v = nn.Linear(query_dim, inner)
        self.norm_q = nn.LayerNorm(dim_head, eps=1e-6)
        self.norm_k = nn.LayerNorm(dim_head, eps=1e-6)
        self.norm_added_q = nn.LayerNorm(dim_head, eps=1e-6)
        self.norm_added_k = nn.LayerNorm(dim_head, eps=1e-6)
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim), nn.Dropout(0.0)])
        _trained(self, 4)

    def forward(self, hidden_states):
        b = hidden_states.shape[0]
        q, k, v = (f(hidden_states).view(b, -1, self.heads, 8).transpose(1, 2) for f in (self.to_q, self.to_k,
                                                                                         self.to_v))
        q, k = self.norm_q(q), self.norm_k(k)
        if self.bug == "kv_swapped":
            q, k, v = q, v, k
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out[0](out.transpose(1, 2).reshape(b, -1, self.heads * 8))


class ReducedSelfAttention(nn.Module):
    """HF Segformer's SegformerEfficientSelfAttention: keys and values from LayerNorm(Conv2d(x)), no output
    projection."""

    def __init__(self, hidden_size=32, num_attention_heads=4, sequence_reduction_ratio=2, bug=None):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.all_head_size = hidden_size
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.sr_ratio = sequence_reduction_ratio
        if sequence_reduction_ratio > 1:
            self.sr = nn.Conv2d(hidden_size, hidden_size, kernel_size=sequence_reduction_ratio,
                                stride=sequence_reduction_ratio)
            self.layer_norm = nn.LayerNorm(hidden_size)
        self.bug = bug
        _trained(self, 5)

    def transpose_for_scores(self, hidden_states):
        new_shape = hidden_states.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return hidden_states.view(new_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, height, width):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        if self.sr_ratio > 1:
            batch_size, seq_len, num_channels = hidden_states.shape
            hidden_states = hidden_states.permute(0, 2, 1).reshape(batch_size, num_channels, height, width)
            hidden_states = self.sr(hidden_states)
            hidden_states = hidden_states.reshape(batch_size, num_channels, -1).permute(0, 2, 1)
            hidden_states = self.layer_norm(hidden_states)
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores((self.key if self.bug == "v_from_k" else self.value)(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_probs = nn.functional.softmax(attention_scores, dim=-2 if self.bug == "softmax_axis" else -1)
        context_layer = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3).contiguous()
        return context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))


class PvtAttention(nn.Module):
    """PVT v1's Attention: q, a fused kv over the spatially reduced sequence, proj."""

    def __init__(self, dim=32, num_heads=4, sr_ratio=2, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        head_dim = dim // num_heads
        self.scale = head_dim ** -0.5
        self.q = nn.Linear(dim, dim, bias=True)
        self.kv = nn.Linear(dim, dim * 2, bias=True)
        self.proj = nn.Linear(dim, dim)
        self.sr_ratio = sr_ratio
        self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio)
        self.norm = nn.LayerNorm(dim)
        _trained(self, 6)

    def forward(self, x, H, W):
        B, N, C = x.shape
        q = self.q(x).reshape(B, N, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        x_ = x.permute(0, 2, 1).reshape(B, C, H, W)
        x_ = self.sr(x_).reshape(B, C, -1).permute(0, 2, 1)
        x_ = self.norm(x_)
        kv = self.kv(x_).reshape(B, -1, 2, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        k, v = kv[0], kv[1]
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class PooledMemory(nn.Module):
    """Keys and values from the sequence pooled to `memory` slots (a pooled memory), queries from every token."""

    def __init__(self, dim=32, heads=4, memory=3, bug=None):
        super().__init__()
        self.heads, self.memory, self.bug = heads, memory, bug
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.to_out = nn.Linear(dim, dim)
        _trained(self, 7)

    def forward(self, x):
        b, n, d = x.shape
        pooled = F.adaptive_avg_pool1d(x.transpose(1, 2), self.memory).transpose(1, 2)  # [b, memory, d]
        q = self.to_q(x)
        k = self.to_k(pooled)
        v = (self.to_k if self.bug == "v_from_k" else self.to_v)(pooled)
        q, k, v = (t.reshape(b, -1, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=d ** -0.5 if self.bug == "scale_d_model" else None)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class BareRmsGain(nn.Module):
    """The gains are the attention module's own parameters: `F.rms_norm(q, (d,)) * self.q_gain`."""

    def __init__(self, dim=32, n_head=4, bug=None):
        super().__init__()
        self.n_head, self.hd, self.bug = n_head, dim // n_head, bug
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))
        self.q_gain = nn.Parameter(torch.ones(self.hd))
        self.k_gain = nn.Parameter(torch.ones(self.hd))
        _trained(self, 8)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (f(x).view(b, n, self.n_head, self.hd).transpose(1, 2) for f in (self.wq, self.wk, self.wv))
        q = F.rms_norm(q, (self.hd,), eps=1e-6) * self.q_gain
        k = F.rms_norm(k, (self.hd,), eps=1e-6) * self.k_gain
        y = F.scaled_dot_product_attention(q, v, k) if self.bug == "kv_swapped" else \
            F.scaled_dot_product_attention(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(b, n, d))


class L2Scaled(nn.Module):
    """x-transformers' qk_norm: l2norm of q and k, then a learned scale per head, `[heads, 1, dim_head]`."""

    def __init__(self, dim=32, heads=4, dim_head=8, bug=None):
        super().__init__()
        self.heads, self.scale, self.bug = heads, dim_head ** -0.5, bug
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)
        self.qk_norm_q_scale = nn.Parameter(torch.ones(heads, 1, dim_head))
        self.qk_norm_k_scale = nn.Parameter(torch.ones(heads, 1, dim_head))
        _trained(self, 9)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for t in (self.to_q(x), self.to_k(x),
                                                                                 self.to_v(x)))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        q = q * self.qk_norm_q_scale
        k = k * self.qk_norm_k_scale
        dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        attn = dots.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, -1))


class BareLayerGain(nn.Module):
    """A LayerNorm written inline with a gain and a bias the attention module holds."""

    def __init__(self, d_model=32, n_heads=4, bug=None):
        super().__init__()
        self.h, self.d_k, self.bug = n_heads, d_model // n_heads, bug
        self.W_Q, self.W_K, self.W_V, self.W_O = (nn.Linear(d_model, d_model) for _ in range(4))
        self.q_w, self.q_b = nn.Parameter(torch.ones(self.d_k)), nn.Parameter(torch.zeros(self.d_k))
        self.k_w, self.k_b = nn.Parameter(torch.ones(self.d_k)), nn.Parameter(torch.zeros(self.d_k))
        _trained(self, 10)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (W(x).view(b, n, self.h, self.d_k).transpose(1, 2) for W in (self.W_Q, self.W_K, self.W_V))
        q = F.layer_norm(q, (self.d_k,), eps=1e-5) * self.q_w + self.q_b
        k = F.layer_norm(k, (self.d_k,), eps=1e-5) * self.k_w + self.k_b
        scores = q @ k.transpose(-2, -1) / math.sqrt(d if self.bug == "scale_d_model" else self.d_k)
        out = scores.softmax(-1) @ v
        return self.W_O(out.transpose(1, 2).contiguous().view(b, n, d))
