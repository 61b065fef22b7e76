"""Modules whose forward takes (query, key, value) and, in self-attention, never reads key and value: fairseq's
MultiheadAttention with self_attention=True (time-first), a batch-first copy of it, and a packed in_proj read from
`query` alone. tests/test_trace_unread_inputs.py runs them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module: nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p)).mul_(1.5)


class FairseqSelf(nn.Module):
    """fairseq's: [T, B, C] in, q scaled before the product, heads folded into the batch [B·H, T, d]."""

    def __init__(self, embed_dim=32, num_heads=4, self_attention=True, bug=None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.scaling, self.self_attention, self.bug = self.head_dim ** -0.5, self_attention, bug
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))
        _trained(self)

    def forward(self, query, key, value, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        if self.self_attention:
            q, k, v = self.q_proj(query), self.k_proj(query), self.v_proj(query)
        else:
            q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        q = q * (1.0 if self.bug == "no_scale" else self.scaling)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:
            attn_weights += attn_mask.unsqueeze(0)
        attn_probs = F.softmax(attn_weights, dim=-1)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn)


class BatchFirstSelf(nn.Module):
    """The same flag, batch-first, heads split with view and transpose(1, 2); a boolean mask, True = may attend."""

    def __init__(self, d_model=32, n_heads=4, self_attention=True, bug=None):
        super().__init__()
        self.h, self.self_attention, self.bug = n_heads, self_attention, bug
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        _trained(self)

    def forward(self, query, key, value, mask=None):
        b, n, d = query.shape
        src = (query, query) if self.self_attention else (key, value)
        q, k, v = (w(x).view(b, -1, self.h, d // self.h).transpose(1, 2)
                   for w, x in ((self.wq, query), (self.wk, src[0]), (self.wv, src[1])))
        s = q @ k.transpose(-2, -1) / (d // self.h) ** 0.5
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        p = s.softmax(-2 if self.bug == "softmax_axis" else -1)
        return self.wo((p @ v).transpose(1, 2).reshape(b, n, d))


class PackedFromQuery(nn.Module):
    """A packed in_proj (nn.MultiheadAttention's weight) applied to `query` alone and chunked in three; key and value
    are in the signature for a caller that hands x three times."""

    def __init__(self, embed_dim=32, num_heads=2, causal=True, bug=None):
        super().__init__()
        self.num_heads, self.causal, self.bug = num_heads, causal, bug
        self.in_proj_weight = nn.Parameter(torch.randn(3 * embed_dim, embed_dim) / embed_dim ** 0.5)
        self.in_proj_bias = nn.Parameter(0.1 * torch.randn(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        _trained(self)

    def forward(self, query, key, value):
        b, n, e = query.shape
        q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        if self.bug == "kv_swapped":
            k, v = v, k
        q, k, v = (t.view(b, n, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, e))
