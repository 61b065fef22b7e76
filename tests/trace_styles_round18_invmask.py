"""Attention that turns its mask round before it applies it, in the forms real libraries write it (round 18's
ChatGLM2 `~attention_mask` handed to SDPA), for tests/test_trace_round18_invmask.py. Each takes `bug=None`: a
planted mistake, which trace names by experiment."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class InvertedSdpa(nn.Module):
    """A Megatron-style core in batch-first form: one fused projection, the mask inverted on its way into
    F.scaled_dot_product_attention. attention_mask: bool, True = masked out (Megatron's, ChatGLM's get_masks)."""

    def __init__(self, d_model=32, n_head=4, bug=None):
        super().__init__()
        self.n_head, self.bug = n_head, bug
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, hidden_states, attention_mask):
        b, n, d = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, n, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        if self.bug == "kv_swapped":
            k, v = v, k
        keep = attention_mask if self.bug == "polarity" else ~attention_mask
        if self.bug == "on_queries":
            keep = keep.transpose(-1, -2)
        scale = 1.0 if self.bug == "scale_none" else None
        context = F.scaled_dot_product_attention(q, k, v, keep, scale=scale)  # [b, h, n, d_head]
        return self.out(context.transpose(1, 2).reshape(b, n, d))


class KeepFill(nn.Module):
    """fairseq-style padding turned into the keys kept, then filled where nothing is kept: `padding_mask` is bool,
    True = padded (key_padding_mask's convention); `keep.eq(0)` inverts it back before masked_fill."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _shape(self, t):
        b, n, _ = t.shape
        return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # [b, n, d] -> [b, h, n, d_head]

    def forward(self, x, padding_mask):
        b, n, d = x.shape
        q, k, v = self._shape(self.q_proj(x)), self._shape(self.k_proj(x)), self._shape(self.v_proj(x))
        scaling = self.head_dim ** -0.5
        if self.bug == "scale_d_head":
            scaling = scaling * scaling
        scores = torch.einsum("bhqd,bhkd->bhqk", q * scaling, k)  # [b, h, n_Q, n_K]
        keep = padding_mask.logical_not()
        if self.bug == "on_queries":
            keep = keep.transpose(-1, -2)
        scores = scores.masked_fill(keep.eq(0), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        context = torch.einsum("bhqk,bhkd->bhqd", probs, v)  # [b, h, n_Q, d_head]
        if self.bug == "merge_no_transpose":
            context = context.reshape(b, n, d)
        else:
            context = context.transpose(1, 2).reshape(b, n, d)
        return self.out_proj(context)


class OneMinusBias(nn.Module):
    """BERT's old extended mask: a float mask, 1 = may attend, turned into `(1 - mask) * -10000` and added to the
    scores (transformers' get_extended_attention_mask before finfo.min)."""

    def __init__(self, hidden_size=32, num_attention_heads=4, bug=None):
        super().__init__()
        self.h, self.d, self.bug = num_attention_heads, hidden_size // num_attention_heads, bug
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def transpose_for_scores(self, x):
        return x.view(*x.shape[:-1], self.h, self.d).permute(0, 2, 1, 3)  # [b, n, h·d] -> [b, h, n, d]

    def forward(self, hidden_states, attention_mask):
        q = self.transpose_for_scores(self.query(hidden_states))
        k = self.transpose_for_scores(self.key(hidden_states))
        v = self.transpose_for_scores(self.value(hidden_states))
        if self.bug == "kv_swapped":
            k, v = v, k
        scores = torch.matmul(q, k.transpose(-1, -2))  # [b, h, n_Q, n_K]
        if self.bug != "scale_none":
            scores = scores / math.sqrt(self.d)
        extended = (1.0 - attention_mask) * -10000.0
        scores = scores + extended
        probs = nn.functional.softmax(scores, dim=-1)
        context = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()  # [b, n, h, d]
        return self.dense(context.view(*context.shape[:2], -1))


class TimeFirstInverted(nn.Module):
    """A ChatGLM-like time-first block of our own: hidden_states [n, b, d], grouped keys and values repeated per
    query head, the mask [b, 1, n_Q, n_K] (bool, True = masked out) inverted with logical_not before SDPA."""

    def __init__(self, d_model=32, n_head=4, n_kv_head=2, bug=None):
        super().__init__()
        self.n_head, self.n_kv_head, self.d_head, self.bug = n_head, n_kv_head, d_model // n_head, bug
        self.wq = nn.Linear(d_model, d_model)
        self.wk = nn.Linear(d_model, n_kv_head * self.d_head)
        self.wv = nn.Linear(d_model, n_kv_head * self.d_head)
        self.wo = nn.Linear(d_model, d_model, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        n, b, d = hidden_states.shape
        q = self.wq(hidden_states).view(n, b, self.n_head, self.d_head)
        k = self.wk(hidden_states).view(n, b, self.n_kv_head, self.d_head)
        v = self.wv(hidden_states).view(n, b, self.n_kv_head, self.d_head)
        group = self.n_head // self.n_kv_head
        if self.bug == "tiled":
            k, v = k.repeat(1, 1, group, 1), v.repeat(1, 1, group, 1)
        else:
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)  # [n, b, n_head, d_head]
        if self.bug == "kv_swapped":
            k, v = v, k
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [n, b, h, d_head] -> [b, h, n, d_head]
        attention_mask = attention_mask.logical_not()
        context = F.scaled_dot_product_attention(q, k, v, attention_mask)  # [b, h, n, d_head]
        if self.bug == "merge_no_transpose":
            context = context.reshape(n, b, d)
        else:
            context = context.permute(2, 0, 1, 3).reshape(n, b, d)
        return self.wo(context)


class WhereBias(nn.Module):
    """A bool mask, True = masked out, written into a float bias by torch.where (-inf where True, 0 elsewhere) and
    handed to SDPA as an additive attn_mask."""

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        if self.bug == "scale_twice":
            q = q / math.sqrt(d // self.heads)
        if self.bug == "on_queries":
            mask = mask.transpose(-1, -2)
        bias = torch.where(mask, float("-inf"), 0.0).to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # [b, h, n, d_head]
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class PaddingOnes(nn.Module):
    """A float 0/1 mask, 1 = masked out, turned into the keys kept by `(1 - mask).bool()` and handed to SDPA."""

    def __init__(self, d_model=32, n_head=4, bug=None):
        super().__init__()
        self.n_head, self.bug = n_head, bug
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x, attention_mask):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).split(d, dim=2))
        if self.bug == "kv_swapped":
            k, v = v, k
        keep = (1 - attention_mask).bool()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # [b, h, n, d_head]
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, n, d))
