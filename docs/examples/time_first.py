"""Attention that takes its inputs time-first, [T, B, C], traced in docs/trace.md ("Time-first inputs"): fairseq's
MultiheadAttention (one in_proj_weight and its bias, heads folded into the batch [B·H, T, d_head] by bmm, an
attn_mask [T, S] added in place), Megatron's core attention ([s, b, h], the heads [s, b, n, d], an einsum), ChatGLM's decode step, and a
function taking its weights and its head count with n_head·d_head ≠ d_model. `bug` plants a mistake.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class FairseqAttention(nn.Module):
    """fairseq's MultiheadAttention, self-attention: forward(query [T, B, C], attn_mask [T, S] added)."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.in_proj_weight = nn.Parameter(torch.randn(3 * embed_dim, embed_dim) * 0.2)
        self.in_proj_bias = nn.Parameter(torch.randn(3 * embed_dim) * 0.1)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.bug = bug

    def forward(self, query, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        q = q * self.scaling
        if self.bug == "split":  # the view straight to [B·H, T, d_head], without the transpose from [T, B·H, d_head]
            q = q.contiguous().view(bsz * self.num_heads, tgt_len, self.head_dim)
        else:
            q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)  # [B·H, T, d_head]
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))  # [B·H, T, S]
        if attn_mask is not None:
            attn_weights += attn_mask.unsqueeze(0)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn = torch.bmm(attn_weights, v)  # [B·H, T, d_head]
        if self.bug == "merge":  # the view without the transpose back to [T, B·H, d_head]
            attn = attn.contiguous().view(tgt_len, bsz, embed_dim)
        else:
            attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn)


class MegatronAttention(nn.Module):
    """Megatron's core: hidden states [s, b, h], its own causal mask (no mask parameter)."""

    def __init__(self, hidden_size=24, num_attention_heads=3, bug=None):
        super().__init__()
        self.n, self.d = num_attention_heads, hidden_size // num_attention_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.bug = bug

    def forward(self, hidden_states):
        s, b, _ = hidden_states.shape
        q = self.query(hidden_states).view(s, b, self.n, self.d)  # [s, b, n, d]
        k = self.key(hidden_states).view(s, b, self.n, self.d)
        v = self.value(hidden_states).view(s, b, self.n, self.d)
        scores = torch.einsum("ibnd,jbnd->bnij", q, k)  # [b, n, s, s]
        if self.bug != "no_scale":
            scores = scores / math.sqrt(self.d)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        context = torch.einsum("bnij,jbnd->ibnd", probs, v)  # [s, b, n, d]
        return self.dense(context.reshape(s, b, self.n * self.d))


class ChatGLMAttention(nn.Module):
    """ChatGLM2's SelfAttention, shrunk: [s, b, h], a fused query_key_value of multi-query groups, its counts under
    names of its own, a decode step's cache (k, v) time-first [s, b, groups, d]."""

    def __init__(self, hidden_size=32, num_attention_heads=4, multi_query_group_num=2, bug=None):
        super().__init__()
        self.np, self.g = num_attention_heads, multi_query_group_num
        self.hn = hidden_size // num_attention_heads
        self.query_key_value = nn.Linear(hidden_size, hidden_size + 2 * self.g * self.hn)
        self.dense = nn.Linear(hidden_size, hidden_size, bias=False)
        self.bug = bug

    def forward(self, hidden_states, kv_cache=None):
        sq, b, _ = hidden_states.shape
        q, k, v = self.query_key_value(hidden_states).split([self.np * self.hn, self.g * self.hn, self.g * self.hn], -1)
        q, k, v = q.view(sq, b, self.np, self.hn), k.view(sq, b, self.g, self.hn), v.view(sq, b, self.g, self.hn)
        if kv_cache is not None:
            cache_k, cache_v = kv_cache
            if self.bug == "cache_order":
                k, v = torch.cat((k, cache_k), dim=0), torch.cat((v, cache_v), dim=0)  # the new keys first
            else:
                k, v = torch.cat((cache_k, k), dim=0), torch.cat((cache_v, v), dim=0)
        k = k.repeat_interleave(self.np // self.g, dim=2)
        v = v.repeat_interleave(self.np // self.g, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, np, s, hn]
        keep = torch.ones(sq, k.shape[2], dtype=torch.bool).tril(k.shape[2] - sq)  # the new rows after the cache
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.dense(context.permute(2, 0, 1, 3).reshape(sq, b, self.np * self.hn))


def attention(x, W_q, W_k, W_v, W_o, n_head, d_head=10):
    """Weights as arguments, W_q [d_model, n_head·d_head] with n_head·d_head ≠ d_model."""
    b, t, _ = x.shape
    q, k, v = ((x @ W).view(b, t, n_head, d_head).transpose(1, 2) for W in (W_q, W_k, W_v))
    att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d_head), dim=-1)
    return (att @ v).transpose(1, 2).reshape(b, t, n_head * d_head) @ W_o
