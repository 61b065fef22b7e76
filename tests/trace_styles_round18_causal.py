"""Attention whose forward takes a causal switch of its own, written in forms of our own: a module called as
torch's nn.MultiheadAttention is, `forward(query, key, value, ..., attn_mask=None, is_causal=False)`, that builds
its causal mask itself where it is asked to and given none; a nanoGPT-like block handing its `causal: bool = False`
on to F.scaled_dot_product_attention's is_causal; a transformers-like layer whose `is_causal=None` builds a boolean
`tril` beside an additive `attention_mask`; a function on split heads with a switch for a local band and another
for the causal mask. Each holds plants (`bug=...`) a user makes."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CalledAsMHA(nn.Module):
    """Multi-head attention, batch first, called as nn.MultiheadAttention is (fairseq's projections);
    `is_causal` builds the causal mask where no attn_mask is given."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.bug = bug

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        bsz, tgt_len, _ = query.shape
        src_len = key.shape[1]
        q = self.q_proj(query).view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(key).view(bsz, src_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(value).view(bsz, src_len, self.num_heads, self.head_dim).transpose(1, 2)
        scale = self.head_dim ** -0.5
        if self.bug == "scale_twice":
            q = q * scale
        scores = torch.matmul(q * scale, k.transpose(-2, -1))  # [bsz, num_heads, tgt_len, src_len]
        if is_causal and attn_mask is None:
            keep = torch.ones(tgt_len, src_len, dtype=torch.bool, device=query.device).tril()
            attn_mask = keep if self.bug == "mask_flipped" else ~keep  # True = masked, as nn.MultiheadAttention's
        if attn_mask is not None:
            scores = scores.masked_fill(attn_mask, torch.finfo(scores.dtype).min)
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(bsz, tgt_len, self.embed_dim)
        out = self.out_proj(out)
        if need_weights:
            return out, weights.mean(1) if average_attn_weights else weights
        return out, None


class NanoFlag(nn.Module):
    """A nanoGPT-like attention whose caller says whether it is causal."""

    def __init__(self, n_embd=32, n_head=4, bug=None):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd
        self.bug = bug

    def forward(self, x, causal: bool = False):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if self.bug == "kv_swapped":
            k, v = v, k
        scale = 1.0 if self.bug == "scale_none" else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=causal, scale=scale)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class FlaggedLayer(nn.Module):
    """A transformers-like self-attention layer: `attention_mask` is additive ([b, 1, n_Q, n_K], 0 = may attend);
    `is_causal` masks the future keys itself."""

    def __init__(self, hidden_size=32, num_attention_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim = num_attention_heads, hidden_size // num_attention_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)
        self.scaling = self.head_dim ** -0.5
        self.bug = bug

    def forward(self, hidden_states, attention_mask=None, is_causal=None):
        shape = (*hidden_states.shape[:-1], self.num_heads, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # [b, h, n, d]
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        scores = torch.matmul(query, key.transpose(2, 3)) * self.scaling  # [b, h, n, n]
        if is_causal:
            n = scores.shape[-1]
            causal = torch.ones(n, n, dtype=torch.bool, device=scores.device).tril(-1 if self.bug == "off_by_one"
                                                                                   else 0)
            scores = scores.masked_fill(causal if self.bug == "mask_flipped" else ~causal,
                                        torch.finfo(scores.dtype).min)
        if attention_mask is not None:
            scores = scores + attention_mask
        weights = F.softmax(scores, dim=-1 if self.bug != "softmax_axis" else -2)
        out = torch.matmul(weights, value).transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)
        return self.o_proj(out)


def switched_attention(q, k, v, local=False, causal=False, window=3, bug=None):
    """Attention of q, k, v [batch, heads, n, d]; `local` hides the keys `window` or more away on either side,
    `causal` the later ones."""
    scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1] if bug != "scale_d_head" else
                                                                q.shape[-1] ** 2)
    i = torch.arange(q.shape[-2], device=q.device)[:, None]
    j = torch.arange(k.shape[-2], device=q.device)[None, :]
    if causal:
        scores = scores.masked_fill(j > i, float("-inf"))
    if local:
        scores = scores.masked_fill((i - j).abs() >= window, float("-inf"))
    weights = scores.softmax(dim=-1)
    if bug == "values_from_keys":
        v = k
    return torch.einsum("bhij,bhjd->bhid", weights, v)


def switched_twice(q, k, v, local=False, causal=False, window=3):
    return switched_attention(q, k, v, local, causal, window, bug="scale_d_head")
