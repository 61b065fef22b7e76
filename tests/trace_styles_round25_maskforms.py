"""Code that takes a 0/1 (or boolean) keep mask but first merges it with a tensor of its own, so that its ops read as
a bias added to something: an OpenAI-GPT-like block merging the padding into its causal buffer and applying it as
`w * b + -1e4 * (1 - b)`; a T5/Pix2Struct-like encoder summing the mask into a zero `position_bias`, then
`(1 - bias) * finfo.min`; a hand-written block summing the padding and its causal buffer and keeping what both allow as
a boolean (`torch.where(keep, scores, -inf)`). Given 0 / -inf, each returns NaN. Plants: the scale left out, the heads
merged without their transpose."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from _trace_ref import trained


def _merge(out, bug):
    """[B, H, N, d] -> [B, N, H·d]; the plant views it without the transpose."""
    B, H, N, d = out.shape
    if bug == "merge_no_transpose":
        return out.reshape(B, N, H * d)
    return out.transpose(1, 2).reshape(B, N, H * d)


class GPTMergedKeep(nn.Module):
    """OpenAI GPT-like: a causal buffer `bias` (1 = may attend), the 0/1 padding multiplied into it, and
    `w = w * b + -1e4 * (1 - b)`; fused c_attn, split by torch.split."""

    def __init__(self, n_embd=32, n_head=4, n_ctx=16, bug=None):
        super().__init__()
        self.n_head, self.bug = n_head, bug
        self.register_buffer("bias", torch.tril(torch.ones(n_ctx, n_ctx)).view(1, 1, n_ctx, n_ctx))
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        trained(self, 23)

    def forward(self, x, attention_mask=None):
        B, N, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, N, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        w = torch.matmul(q, k.transpose(-2, -1))
        if self.bug != "no_scale":
            w = w / math.sqrt(v.size(-1))
        b = self.bias[:, :, :N, :N]
        if attention_mask is not None:
            b = b * attention_mask
        w = w * b + -1e4 * (1 - b)
        w = F.softmax(w, dim=-1)
        return self.c_proj(_merge(torch.matmul(w, v), self.bug))


class T5ZeroBias(nn.Module):
    """T5-like encoder attention without relative attention: a zero `position_bias` [1, H, N, N] the mask is summed
    into, then `(1.0 - position_bias) * finfo.min` added to unscaled scores (T5's Mesh-TF init), einsum scores."""

    def __init__(self, d_model=32, n_heads=4, bug=None):
        super().__init__()
        self.n_heads, self.bug = n_heads, bug
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        trained(self, 23)

    def forward(self, hidden_states, mask=None):
        B, N, D = hidden_states.shape
        q, k, v = (p(hidden_states).view(B, N, self.n_heads, -1) for p in (self.q, self.k, self.v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k)
        if self.bug == "scaled":
            scores = scores / math.sqrt(q.shape[-1])
        position_bias = torch.zeros(1, self.n_heads, N, N, dtype=scores.dtype)
        if mask is not None:
            position_bias = position_bias + mask
            position_bias = (1.0 - position_bias) * torch.finfo(scores.dtype).min
        weights = F.softmax((scores + position_bias).float(), dim=-1).type_as(scores)
        out = torch.einsum("bhqk,bkhd->bhqd", weights, v)
        return self.o(_merge(out, self.bug))


class SummedKeep(nn.Module):
    """Hand-written: the padding and a causal buffer (0/1 each) summed, `keep = summed > 1.5` a boolean of the keys
    both allow, `torch.where(keep, scores, -inf)` and F.softmax; q, k, v projected apart."""

    def __init__(self, dim=24, heads=3, max_len=16, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len)), persistent=False)
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)
        trained(self, 23)

    def forward(self, x, pad_mask=None):
        B, N, D = x.shape
        q, k, v = (f(x).view(B, N, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        scores = q @ k.transpose(-1, -2)
        if self.bug != "no_scale":
            scores = scores * q.shape[-1] ** -0.5
        summed = self.causal[:N, :N] + (pad_mask if pad_mask is not None else 1.0)
        keep = summed > 1.5
        attn = torch.where(keep, scores, float("-inf")).softmax(dim=-1)
        return self.to_out(_merge(attn @ v, self.bug))
