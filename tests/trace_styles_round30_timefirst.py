"""Styles of our own for tests/test_trace_round30_timefirst.py: time-first attention, `[n, n_batch, d]`, that takes
its masks in its own convention (issue #41). Weights moved off their initial values.

- SeqFirstMHA: fairseq-like, forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None),
  heads folded into the batch `[n_batch·n_head, n, d_head]`, attn_mask `[n_Q, n_K]` additive (broadcast over the
  folded batch), key_padding_mask `[n_batch, n_K]` True = pad, filled with -inf. With `self_attn=True` it projects
  q, k and v from `query` alone (its key and value unread). `bug`: 'scaled_twice' (q scaled, the scores again),
  'pad_zero' (the padded keys' scores filled with 0), 'kv_swapped' (k = v_proj(key), v = k_proj(value)).
- PackedMHA: a hand-written nn.MultiheadAttention(batch_first=False): one packed in_proj_weight `[3·C, C]` chunked,
  a boolean attn_mask `[n_Q, n_K]` True = masked, key_padding_mask `[n_batch, n_K]` True = pad, both turned into a
  float mask of -inf. `bug`: 'softmax_axis' (over the queries), 'merge' (the heads' outputs viewed straight as
  `[n, n_batch, C]`). (Its packed chunks' order is read from their use, so a k/v swap there is a convention.)
- CoreSBH: a Megatron-like core, hidden states `[s, b, h]`, a fused QKV viewed `[s, b, np, 3·hn]`, a boolean
  attention_mask `[b, 1, s, s]` True = masked, filled with -inf before the softmax. `bug`: 'merge' (context
  `[b, np, s, hn]` viewed as `[s, b, h]` without its permute), 'kv_swapped' (the parts named key and value, each
  used as the other), 'softmax_axis'; 'qvk_layout' is correct code whose checkpoint lays each head q | v | k and
  whose split names them so (CodeGen's order).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def trained(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)  # the same weights in each instance of a class


class SeqFirstMHA(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, self_attn=False, bug=""):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.self_attn, self.bug = self_attn, bug
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        trained(self, 30)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        if self.self_attn:
            key = value = query
        if self.bug == "kv_swapped":
            q, k, v = self.q_proj(query), self.v_proj(key), self.k_proj(value)
        else:
            q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        q = q * self.scaling
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        src_len = k.size(1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if self.bug == "scaled_twice":
            attn_weights = attn_weights * self.scaling
        if attn_mask is not None:
            attn_weights = attn_weights + attn_mask.unsqueeze(0)
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            fill = 0.0 if self.bug == "pad_zero" else float("-inf")
            attn_weights = attn_weights.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), fill)
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_probs = F.softmax(attn_weights, dim=-1)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn), (attn_probs if need_weights else None)


class PackedMHA(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, batch_first=False, bug=""):
        super().__init__()
        self.embed_dim, self.num_heads, self.batch_first, self.bug = embed_dim, num_heads, batch_first, bug
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        trained(self, 31)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None):
        if self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        tgt_len, bsz, embed_dim = query.shape
        src_len = key.shape[0]
        head_dim = embed_dim // self.num_heads
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        q = F.linear(query, w_q, b_q)
        k = F.linear(key, w_k, b_k)
        v = F.linear(value, w_v, b_v)
        q = q.view(tgt_len, bsz * self.num_heads, head_dim).transpose(0, 1)
        k = k.view(src_len, bsz * self.num_heads, head_dim).transpose(0, 1)
        v = v.view(src_len, bsz * self.num_heads, head_dim).transpose(0, 1)
        bias = torch.zeros(bsz, self.num_heads, tgt_len, src_len, dtype=q.dtype)
        if attn_mask is not None:
            bias = bias.masked_fill(attn_mask.view(1, 1, tgt_len, src_len), float("-inf"))
        if key_padding_mask is not None:
            bias = bias.masked_fill(key_padding_mask.view(bsz, 1, 1, src_len), float("-inf"))
        scores = torch.baddbmm(bias.view(bsz * self.num_heads, tgt_len, src_len), q / math.sqrt(head_dim),
                               k.transpose(-2, -1))
        probs = scores.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        out = torch.bmm(probs, v)
        if self.bug == "merge":
            out = out.reshape(tgt_len, bsz, embed_dim)
        else:
            out = out.transpose(0, 1).reshape(tgt_len * bsz, embed_dim).view(tgt_len, bsz, embed_dim)
        out = self.out_proj(out)
        if self.batch_first:
            out = out.transpose(0, 1)
        weights = probs.view(bsz, self.num_heads, tgt_len, src_len).mean(dim=1) if need_weights else None
        return out, weights


class CoreSBH(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4, bug=""):
        super().__init__()
        self.np, self.hn = num_attention_heads, hidden_size // num_attention_heads
        self.norm_factor = math.sqrt(self.hn)
        self.bug = bug
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        trained(self, 32)

    def forward(self, hidden_states, attention_mask):
        sq, b, h = hidden_states.shape
        mixed = self.query_key_value(hidden_states).view(sq, b, self.np, 3 * self.hn)
        if self.bug == "qvk_layout":  # a checkpoint laid q | v | k per head (CodeGen's order), named so: correct
            query_layer, value_layer, key_layer = torch.split(mixed, self.hn, dim=3)
        else:
            query_layer, key_layer, value_layer = torch.split(mixed, self.hn, dim=3)
        if self.bug == "kv_swapped":  # the parts named key and value, each used as the other
            key_layer, value_layer = value_layer, key_layer
        sk = key_layer.size(0)
        q = query_layer.reshape(sq, b * self.np, self.hn)
        k = key_layer.reshape(sk, b * self.np, self.hn)
        scores = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)) / self.norm_factor
        scores = scores.view(b, self.np, sq, sk)
        scores = scores.masked_fill(attention_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-2 if self.bug == "softmax_axis" else -1)
        v = value_layer.reshape(sk, b * self.np, self.hn).transpose(0, 1)
        context = torch.bmm(probs.view(b * self.np, sq, sk), v).view(b, self.np, sq, self.hn)
        if self.bug != "merge":
            context = context.permute(2, 0, 1, 3).contiguous()
        return self.dense(context.view(sq, b, h))
