"""Keys and values projected part by part and joined after the projection, a prefix then the queries' own tokens
(Perceiver AR's causal prefix attention): the queries come from the last tokens x, the keys and values from the
context and x alike, a causal rule aligned lower-right over the joined keys. Three idioms: a lucidrains-like block
with layer norms, one fused `to_kv` chunked in two and heads processed a few at a time with einsum and a key padding
mask padded over x's keys; a transformers-like one with separate k_proj and v_proj whose keys are joined after the
heads are split, into F.scaled_dot_product_attention with a boolean `tril` mask; a functional one with its weights as
Parameters, heads folded into the batch for bmm and an additive mask. Plants: the scale left out, the mask aligned
upper-left or off by one, the heads merged with the wrong permute."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from _trace_ref import trained


def _causal(n_q, n_k, bug):
    """True where the query may not attend: lower-right (the n_q queries are the last of n_k keys)."""
    if bug == "upper_left":
        return torch.ones(n_q, n_k, dtype=torch.bool).triu(1)
    if bug == "off_by_one":
        return torch.ones(n_q, n_k, dtype=torch.bool).triu(n_k - n_q)
    return torch.ones(n_q, n_k, dtype=torch.bool).triu(n_k - n_q + 1)


class ChunkedPrefix(nn.Module):
    """lucidrains-like: `norm(x)`, `context_norm(context)`, one fused `to_kv` run on each and chunked, the keys
    `cat((k_context, k_x), dim=-2)` before the heads split, heads two at a time with einsum, a key padding mask over
    the context padded with True over x's keys."""

    def __init__(self, dim=24, heads=4, dim_head=6, heads_at_once=2, bug=None):
        super().__init__()
        self.heads, self.heads_at_once, self.bug = heads, heads_at_once, bug
        self.scale = dim_head ** -0.5
        inner = heads * dim_head
        self.norm, self.context_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, 2 * inner, bias=False)
        self.to_out = nn.Linear(inner, dim)
        trained(self, 23, shift=0.02)

    def forward(self, x, context, context_mask=None):
        x, context = self.norm(x), self.context_norm(context)
        q = self.to_q(x)
        k_x, v_x = self.to_kv(x).chunk(2, dim=-1)
        k_c, v_c = self.to_kv(context).chunk(2, dim=-1)
        k, v = torch.cat((k_c, k_x), dim=-2), torch.cat((v_c, v_x), dim=-2)
        b = q.shape[0]
        q, k, v = (t.reshape(b, t.shape[1], self.heads, -1).permute(0, 2, 1, 3) for t in (q, k, v))
        if self.bug != "no_scale":
            q = q * self.scale
        i, j = q.shape[-2], k.shape[-2]
        blocked = _causal(i, j, self.bug)
        if context_mask is not None:
            context_mask = F.pad(context_mask, (0, j - context_mask.shape[-1]), value=True)[:, None, None, :]
        outs = []
        for qc, kc, vc in zip(q.split(self.heads_at_once, dim=1), k.split(self.heads_at_once, dim=1),
                              v.split(self.heads_at_once, dim=1), strict=True):
            sim = torch.einsum("bhid,bhjd->bhij", qc, kc)
            if context_mask is not None:
                sim = sim.masked_fill(~context_mask, -torch.finfo(sim.dtype).max)
            sim = sim.masked_fill(blocked, -torch.finfo(sim.dtype).max)
            outs.append(torch.einsum("bhij,bhjd->bhid", sim.softmax(dim=-1), vc))
        out = torch.cat(outs, dim=1)
        if self.bug == "merge_wrong":
            out = out.permute(0, 2, 3, 1).reshape(b, i, -1)
        else:
            out = out.permute(0, 2, 1, 3).reshape(b, i, -1)
        return self.to_out(out)


class SplitJoinedPrefix(nn.Module):
    """transformers-like: q_proj, k_proj, v_proj with biases, an RMS norm of the hidden states and one of the prefix,
    the heads split with `view(...).transpose(1, 2)` before the prefix's and the tokens' keys are joined on the token
    axis (dim=2), F.scaled_dot_product_attention with a boolean may-attend mask."""

    def __init__(self, hidden_size=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.input_norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.prefix_norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)
        trained(self, 23, shift=0.02)

    def _shape(self, t):
        return t.view(t.shape[0], t.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, prefix_states):
        hidden_states, prefix_states = self.input_norm(hidden_states), self.prefix_norm(prefix_states)
        query = self._shape(self.q_proj(hidden_states))
        key = torch.cat([self._shape(self.k_proj(prefix_states)), self._shape(self.k_proj(hidden_states))], dim=2)
        value = torch.cat([self._shape(self.v_proj(prefix_states)), self._shape(self.v_proj(hidden_states))], dim=2)
        allowed = ~_causal(query.shape[2], key.shape[2], self.bug)
        scale = 1.0 if self.bug == "no_scale" else None
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale)
        bsz, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(bsz, n, -1))


class FoldedPrefix(nn.Module):
    """Functional, weights as Parameters: `F.linear` of the memory and of x with one key weight (and one value
    weight), joined along the tokens, heads folded into the batch ([B·heads, n, d]) for torch.bmm, the causal rule
    as an additive -inf bias."""

    def __init__(self, d_model=16, n_heads=2, bug=None):
        super().__init__()
        self.n_heads, self.bug = n_heads, bug
        self.wq, self.wk, self.wv, self.wo = (nn.Parameter(torch.randn(d_model, d_model) / math.sqrt(d_model))
                                              for _ in range(4))
        trained(self, 23, shift=0.02)

    def _fold(self, t):
        B, N, D = t.shape
        return t.reshape(B, N, self.n_heads, D // self.n_heads).transpose(1, 2).reshape(B * self.n_heads, N, -1)

    def forward(self, x, memory):
        B, N, D = x.shape
        q = self._fold(F.linear(x, self.wq))
        k = self._fold(torch.cat([F.linear(memory, self.wk), F.linear(x, self.wk)], dim=1))
        v = self._fold(torch.cat([F.linear(memory, self.wv), F.linear(x, self.wv)], dim=1))
        scores = torch.bmm(q, k.transpose(1, 2))
        if self.bug != "no_scale":
            scores = scores / math.sqrt(D // self.n_heads)
        bias = torch.zeros(N, k.shape[1]).masked_fill(_causal(N, k.shape[1], self.bug), float("-inf"))
        out = torch.bmm((scores + bias).softmax(dim=-1), v)  # [B·heads, N, d]
        out = out.reshape(B, self.n_heads, N, -1).transpose(1, 2).reshape(B, N, D)
        return F.linear(out, self.wo)
