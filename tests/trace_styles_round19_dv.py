"""Attention whose values are not as wide as its queries and keys (d_K ≠ d_V per head), and whose keys' and values'
side has an input norm of its own (round 19's d_V), for tests/test_trace_round19_dv.py. Each takes `bug=None` or a
planted mistake trace names by experiment: `scale_v` (the scores divided by √d_V, not √d_K), `softmax_axis` (over the
queries), `merge_no_permute` (the heads' outputs viewed back without moving the heads behind the tokens),
`mask_polarity` (the padding read the other way round), `no_scale`, `tiled` (key/value heads repeated as a whole
rather than each in turn). perceiver-pytorch's `masked_fill(~mask, ..)` with its `~` left out would read every mask the
other way round, a convention no run tells from a mistake, so `LatentReader`'s plants leave its mask alone.

- `LatentReader`: perceiver-pytorch's habit: learned latents normed by one LayerNorm, the data by another
  (`norm_context`), the keys and values from one fused Linear split by their two widths, einsum scores, a boolean
  padding into `masked_fill(~mask, -max)`.
- `ContextCross`: diffusers' classic `AttnProcessor` for a UNet's cross-attention: the encoder's states
  (`cross_attention_dim` wide) through `norm_cross` and a GroupNorm-free query side, the heads folded into the batch
  (`head_to_batch_dim`), scores by `torch.baddbmm` onto the additive padding bias repeated per head, values of their
  own width, `to_out[0]`.
- `WideValues`: a decoder's self-attention with grouped key/value heads and RoPE (rotate_half) on q and k, the values
  wider than the keys, `F.scaled_dot_product_attention(..., is_causal=True)` after `repeat_interleave`.
- `NaiveMla`: DeepSeek-V2's attention as transformers' eager code writes it, every head's keys and values expanded
  from the latent (no absorbed weights, no cache): q of d_nope + d_rope per head, the latent through an RMSNorm and
  up-projected to d_nope + d_V per head, the rotary part shared by the heads and turned half-split, so d_K = d_nope
  + d_rope ≠ d_V; causal.
- `CachedValues`: a decode step whose cache holds keys d_K wide and values d_V wide per head, joined to the new ones,
  its causal band aligned to the last key by hand (`upper_left`: to the first).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def _grown(module, seed):
    """Move every weight off its initial value, as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)


def _merged(out, bug):
    """[b, h, n, d] -> [b, n, h·d]; `merge_no_permute`: viewed so without moving the heads behind the tokens."""
    b, h, n, d = out.shape
    if bug == "merge_no_permute":
        return out.reshape(b, n, h * d)
    return out.transpose(1, 2).reshape(b, n, h * d)


class LatentReader(nn.Module):
    def __init__(self, num_latents=4, latent_dim=24, context_dim=12, heads=3, dim_qk=6, dim_v=4, bug=None):
        super().__init__()
        self.bug, self.heads, self.dim_qk, self.dim_v = bug, heads, dim_qk, dim_v
        self.latents = nn.Parameter(torch.randn(num_latents, latent_dim))
        self.norm_latents = nn.LayerNorm(latent_dim)
        self.norm_context = nn.LayerNorm(context_dim)
        self.to_q = nn.Linear(latent_dim, heads * dim_qk, bias=False)
        self.to_kv = nn.Linear(context_dim, heads * (dim_qk + dim_v), bias=False)
        self.to_out = nn.Linear(heads * dim_v, latent_dim)
        _grown(self, 1)

    def forward(self, data, mask=None):
        b, h = data.shape[0], self.heads
        x = self.norm_latents(self.latents).unsqueeze(0).expand(b, -1, -1)
        context = self.norm_context(data)
        q = self.to_q(x)
        k, v = self.to_kv(context).split([h * self.dim_qk, h * self.dim_v], dim=-1)
        q, k, v = (t.unflatten(-1, (h, -1)).transpose(1, 2) for t in (q, k, v))  # b n (h d) -> b h n d
        d = self.dim_v if self.bug == "scale_v" else self.dim_qk
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * (1.0 if self.bug == "no_scale" else d ** -0.5)
        if mask is not None:
            keep = mask[:, None, None, :] if self.bug != "mask_polarity" else ~mask[:, None, None, :]
            sim = sim.masked_fill(~keep, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(_merged(out, self.bug))


class ContextCross(nn.Module):
    def __init__(self, query_dim=32, cross_attention_dim=20, heads=4, dim_head=6, value_dim_head=10, bug=None):
        super().__init__()
        self.bug, self.heads = bug, heads
        self.scale = (value_dim_head if bug == "scale_v" else dim_head) ** -0.5
        self.norm_cross = nn.LayerNorm(cross_attention_dim)
        self.to_q = nn.Linear(query_dim, heads * dim_head, bias=False)
        self.to_k = nn.Linear(cross_attention_dim, heads * dim_head, bias=False)
        self.to_v = nn.Linear(cross_attention_dim, heads * value_dim_head, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(heads * value_dim_head, query_dim), nn.Dropout(0.0)])
        _grown(self, 2)

    def head_to_batch_dim(self, tensor):
        b, n, dim = tensor.shape
        tensor = tensor.reshape(b, n, self.heads, dim // self.heads).permute(0, 2, 1, 3)
        return tensor.reshape(b * self.heads, n, dim // self.heads)

    def batch_to_head_dim(self, tensor):
        bh, n, d = tensor.shape
        if self.bug == "merge_no_permute":
            return tensor.reshape(bh // self.heads, n, d * self.heads)
        tensor = tensor.reshape(bh // self.heads, self.heads, n, d).permute(0, 2, 1, 3)
        return tensor.reshape(bh // self.heads, n, d * self.heads)

    def forward(self, hidden_states, encoder_hidden_states, attention_mask=None):
        encoder_hidden_states = self.norm_cross(encoder_hidden_states)
        query = self.head_to_batch_dim(self.to_q(hidden_states))
        key = self.head_to_batch_dim(self.to_k(encoder_hidden_states))
        value = self.head_to_batch_dim(self.to_v(encoder_hidden_states))
        n_Q, n_K = query.shape[1], key.shape[1]
        if attention_mask is None:
            bias = query.new_zeros(query.shape[0], n_Q, n_K)
        else:
            keep = attention_mask.to(query.dtype)
            keep = 1.0 - keep if self.bug == "mask_polarity" else keep
            bias = ((1.0 - keep) * -10000.0)[:, None, :].repeat_interleave(self.heads, dim=0)  # [b·h, 1, n_K]
        scores = torch.baddbmm(bias, query, key.transpose(-1, -2), beta=1, alpha=self.scale)
        probs = scores.softmax(dim=1 if self.bug == "softmax_axis" else -1)
        hidden_states = self.batch_to_head_dim(torch.bmm(probs, value))
        return self.to_out[1](self.to_out[0](hidden_states))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _inv_freq(d, base):
    return 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)


def _cos_sin(inv_freq, n, dtype):
    """transformers' rotary tables for positions 0 .. n − 1, the halves' angles repeated: [n, d]."""
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class WideValues(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, num_key_value_heads=2, head_dim=8, v_head_dim=12,
                 rope_theta=10000.0, bug=None):
        super().__init__()
        self.bug, self.h, self.kv, self.d, self.dv = bug, num_heads, num_key_value_heads, head_dim, v_head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=True)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=True)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * v_head_dim, bias=True)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)
        self.register_buffer("inv_freq", _inv_freq(head_dim, rope_theta), persistent=False)
        _grown(self, 3)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, self.h, self.d).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, n, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, n, self.kv, self.dv).transpose(1, 2)
        cos, sin = _cos_sin(self.inv_freq, n, q.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        group = self.h // self.kv
        if self.bug == "tiled":
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        else:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scale = self.dv ** -0.5 if self.bug == "scale_v" else None
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self.o_proj(_merged(out, self.bug))


class NaiveMla(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4,
                 v_head_dim=5, rope_theta=10000.0, bug=None):
        super().__init__()
        self.bug, self.h = bug, num_heads
        self.d_nope, self.d_rope, self.d_v, self.rank = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
        self.q_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)
        self.register_buffer("inv_freq", _inv_freq(qk_rope_head_dim, rope_theta), persistent=False)
        _grown(self, 4)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, self.h, self.q_head_dim).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.d_nope, self.d_rope], dim=-1)
        compressed_kv, k_pe = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.rank, self.d_rope], dim=-1)
        k_pe = k_pe.view(b, n, 1, self.d_rope).transpose(1, 2)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed_kv)).view(b, n, self.h, self.d_nope + self.d_v)
        k_nope, value_states = torch.split(kv.transpose(1, 2), [self.d_nope, self.d_v], dim=-1)
        cos, sin = _cos_sin(self.inv_freq, n, q.dtype)
        q_pe, k_pe = q_pe * cos + rotate_half(q_pe) * sin, k_pe * cos + rotate_half(k_pe) * sin
        query_states = torch.cat([q_nope, q_pe], dim=-1)
        key_states = torch.cat([k_nope, k_pe.expand(b, self.h, n, self.d_rope)], dim=-1)
        d = self.d_v if self.bug == "scale_v" else self.q_head_dim
        scores = query_states @ key_states.transpose(2, 3)
        if self.bug != "no_scale":
            scores = scores / math.sqrt(d)
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        weights = F.softmax(scores, dim=-2 if self.bug == "softmax_axis" else -1, dtype=torch.float32)
        out = weights.to(q.dtype) @ value_states
        return self.o_proj(_merged(out, self.bug))


class CachedValues(nn.Module):
    """A decode step's cache of keys and values of two widths (`past_key_value`, d_K and d_V per head), joined to the
    new ones, the causal band aligned to the last key."""

    def __init__(self, dim=32, num_heads=4, head_dim=8, v_head_dim=6, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.v_head_dim, self.bug = num_heads, head_dim, v_head_dim, bug
        self.q_proj = nn.Linear(dim, num_heads * head_dim)
        self.k_proj = nn.Linear(dim, num_heads * head_dim)
        self.v_proj = nn.Linear(dim, num_heads * v_head_dim)
        self.o_proj = nn.Linear(num_heads * v_head_dim, dim)
        _grown(self, 5)

    def forward(self, x, past_key_value=None):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_heads, self.v_head_dim).transpose(1, 2)
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        n_k = k.shape[2]
        allowed = torch.ones(n, n_k, dtype=torch.bool).tril(n_k - n if self.bug != "upper_left" else 0)
        scale = self.v_head_dim ** -0.5 if self.bug == "scale_v" else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        return self.o_proj(_merged(out, self.bug))
