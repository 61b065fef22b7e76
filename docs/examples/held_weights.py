"""Weights the code reshapes, and q, k, v clipped (docs/trace.md, "Weights held as nn.Parameter" and "q, k and v
clipped"): modded-nanogpt's speedrun attention (one qkv_w [3, hdim, dim] handed to F.linear flattened, qk-norm
without weights, a learned gain on v; its half-truncated RoPE left out) and DBRX's fused Wqkv clamped to ±clip_qkv,
each with a `bug`."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class CastedLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight.type_as(x))


class SpeedrunAttention(nn.Module):
    """modded-nanogpt's CausalSelfAttention, its rotary left out: bug='scale_twice' scales q before an SDPA that
    scales again."""

    def __init__(self, dim=32, num_heads=4, head_dim=8, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, head_dim, bug
        bound = 3 ** 0.5 * 0.5 * dim ** -0.5
        self.qkv_w = nn.Parameter(torch.empty(3, num_heads * head_dim, dim).uniform_(-bound, bound))
        self.lambdas = nn.Parameter(torch.tensor([0.5, 0.5]))
        self.c_proj = CastedLinear(num_heads * head_dim, dim, bias=False)
        self.attn_scale = 0.12

    def forward(self, x, ve=None):
        B, T = x.size(0), x.size(1)
        q, k, v = F.linear(x, self.qkv_w.flatten(end_dim=1).type_as(x)).view(
            B, T, 3 * self.num_heads, self.head_dim).chunk(3, dim=-2)
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        v = self.lambdas[0] * v if ve is None else self.lambdas[0] * v + self.lambdas[1] * ve.view_as(v)
        if self.bug == "scale_twice":
            q = q * self.attn_scale
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           scale=self.attn_scale).transpose(1, 2)
        return self.c_proj(y.contiguous().view(B, T, self.num_heads * self.head_dim))


class AttnConfig:
    def __init__(self, clip_qkv=0.5, kv_n_heads=2):
        self.clip_qkv, self.kv_n_heads = clip_qkv, kv_n_heads


class DbrxLikeAttention(nn.Module):
    """DBRX's attention, shrunk (no RoPE): q, k, v clipped to ±attn_config.clip_qkv; bug='d_model' scales the
    scores by 1/√d_model."""

    def __init__(self, d_model=32, n_heads=4, attn_config=None, bug=None):
        super().__init__()
        self.attn_config = attn_config or AttnConfig()
        self.n_heads, self.kv_heads, self.bug = n_heads, self.attn_config.kv_n_heads, bug
        self.head_dim = d_model // n_heads
        self.Wqkv = nn.Linear(d_model, d_model + 2 * self.kv_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, hidden_states):
        b, n, d = hidden_states.shape
        clip = self.attn_config.clip_qkv
        qkv = self.Wqkv(hidden_states).clamp(min=-clip, max=clip)
        q, k, v = qkv.split([d, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=2)
        q = q.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = (t.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2) for t in (k, v))
        k, v = (t.repeat_interleave(self.n_heads // self.kv_heads, 1) for t in (k, v))
        w = q @ k.transpose(2, 3) / math.sqrt(d if self.bug == "d_model" else self.head_dim)
        return self.out_proj((w.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))
