"""Attention in Keras' EinsumDense style, for tests/test_trace_timefirst.py: 3-D kernels [d, n_head, d_head] projecting
with torch.einsum("btd,dhk->bthk", x, W), the output kernel [n_head, d_head, d] with "bthk,hkd->btd", as the ports
of keras.layers.MultiHeadAttention write it. Each class takes `bug` to plant one mistake the way people make it;
"" is the correct code."""

import math

import torch
from torch import nn


def _kernel(*shape, fan_in):
    return nn.Parameter(torch.randn(*shape) / math.sqrt(fan_in))


class KerasSelfAttention(nn.Module):
    """key_dim 10 with 3 heads on d 24: the kernels' head axis is not d / n_head; attention_mask 1 = attend."""

    def __init__(self, d=24, num_heads=3, key_dim=10, bug=""):
        super().__init__()
        self.key_dim = key_dim
        self.q_kernel, self.k_kernel, self.v_kernel = (_kernel(d, num_heads, key_dim, fan_in=d) for _ in "qkv")
        self.o_kernel = _kernel(num_heads, key_dim, d, fan_in=num_heads * key_dim)
        self.bug = bug

    def forward(self, x, attention_mask=None):
        q = torch.einsum("btd,dhk->bthk", x, self.q_kernel)  # [B, T, H, key_dim]
        k = torch.einsum("btd,dhk->bthk", x, self.k_kernel)
        v = torch.einsum("btd,dhk->bthk", x, self.v_kernel)
        if self.bug == "kv_swap":
            k, v = v, k
        scores = torch.einsum("bqhk,bshk->bhqs", q, k)  # [B, H, T, S]
        if self.bug != "no_scale":
            scores = scores / math.sqrt(self.key_dim)
        if attention_mask is not None:
            keep = attention_mask.bool()[:, None] if attention_mask.dim() == 3 else attention_mask.bool()
            scores = scores.masked_fill(keep if self.bug == "polarity" else ~keep, float("-inf"))
        weights = scores.softmax(dim=-2 if self.bug == "axis" else -1)
        out = torch.einsum("bhqs,bshk->bqhk", weights, v)  # [B, T, H, key_dim]
        return torch.einsum("bthk,hkd->btd", out, self.o_kernel)
