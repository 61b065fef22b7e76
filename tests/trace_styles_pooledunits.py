"""Mask unit attention at a stage transition, its queries pooled inside each unit (tests/test_trace_pooledunits.py).

Two styles of Hiera's `MaskUnitAttention`: transformers' (models/hiera/modeling_hiera.py, HieraMaskUnitAttention:
`(query * scale) @ key^T`, softmax, `@ value`) and facebookresearch/hiera's (`F.scaled_dot_product_attention(q, k,
v)`). The tokens arrive unrolled into mask units, token t in unit t % units; one fused qkv Linear is reshaped to
`[B, tokens_per_unit, units, 3, heads, d]` and permuted `(3, 0, 4, 2, 1, 5)`; the queries are max-pooled over
`q_stride` inside each unit; each unit's pooled queries attend over its own keys alone; `.transpose(1, 3)` puts the
tokens back before the merge. The width grows at the transition (24 -> 48).

Planted (bug=...): scale_twice (the scores scaled again after the scaled queries), softmax_queries (dim=-2),
no_transpose (the merge without `.transpose(1, 3)`), units_shifted (each unit's queries against the next unit's
keys and values: `torch.roll(.., 1, dims=2)`)."""

import torch.nn.functional as F
from torch import nn


class UnitsPooled(nn.Module):
    def __init__(self, dim=24, dim_out=48, heads=4, q_stride=2, window_size=3, bug=None):
        super().__init__()
        self.heads, self.q_stride, self.dim_out, self.bug = heads, q_stride, dim_out, bug
        self.head_dim = dim_out // heads
        self.scale = self.head_dim ** -0.5
        self.window_size = window_size
        self.qkv = nn.Linear(dim, 3 * dim_out)
        self.proj = nn.Linear(dim_out, dim_out)

    def forward(self, hidden_states):
        batch_size, seq_len, _ = hidden_states.shape
        num_windows = seq_len // (self.q_stride * self.window_size)
        qkv = self.qkv(hidden_states)
        qkv = qkv.reshape(batch_size, -1, num_windows, 3, self.heads, self.head_dim).permute(3, 0, 4, 2, 1, 5)
        query, key, value = qkv.unbind(0)
        if self.bug == "units_shifted":
            key, value = key.roll(1, dims=2), value.roll(1, dims=2)
        query = query.view(batch_size, self.heads, num_windows, self.q_stride, -1, self.head_dim).max(dim=3).values
        attn_weights = (query * self.scale) @ key.transpose(-1, -2)
        if self.bug == "scale_twice":
            attn_weights = attn_weights * self.scale
        attn_weights = attn_weights.softmax(dim=-2 if self.bug == "softmax_queries" else -1)
        attn_output = attn_weights @ value
        if self.bug != "no_transpose":
            attn_output = attn_output.transpose(1, 3)
        return self.proj(attn_output.reshape(batch_size, -1, self.dim_out))


class MaskUnitAttention(nn.Module):
    """facebookresearch/hiera's hiera.py, its `F.scaled_dot_product_attention` path."""

    def __init__(self, dim=24, dim_out=48, heads=4, q_stride=2, window_size=3, use_mask_unit_attn=True, bug=None):
        super().__init__()
        self.dim, self.dim_out, self.heads, self.q_stride = dim, dim_out, heads, q_stride
        self.head_dim = dim_out // heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim_out)
        self.proj = nn.Linear(dim_out, dim_out)
        self.window_size, self.use_mask_unit_attn, self.bug = window_size, use_mask_unit_attn, bug

    def forward(self, x):
        B, N, _ = x.shape
        num_windows = (N // (self.q_stride * self.window_size)) if self.use_mask_unit_attn else 1
        qkv = self.qkv(x).reshape(B, -1, num_windows, 3, self.heads, self.head_dim).permute(3, 0, 4, 2, 1, 5)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.bug == "units_shifted":
            k, v = k.roll(1, dims=2), v.roll(1, dims=2)
        if self.q_stride > 1:
            q = q.view(B, self.heads, num_windows, self.q_stride, -1, self.head_dim).max(dim=3).values
        x = F.scaled_dot_product_attention(q, k, v, scale=self.scale ** 2 if self.bug == "scale_twice" else None)
        if self.bug != "no_transpose":
            x = x.transpose(1, 3)
        x = x.reshape(B, -1, self.dim_out)
        return self.proj(x)
