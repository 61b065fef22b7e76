"""Heads and projections in the forms students and papers write them (round 16's heads), for
tests/test_trace_round16_heads.py. Each takes `bug=None`: a mistake planted the way people make it, which trace names
by experiment.

- Heads computed one at a time, their outputs concatenated, with or without an output projection: a book's wrapper
  of causal single-head modules, a video's `Head` list (with `proj`, or without), a list of per-head weight
  matrices `x @ W[h]` stacked and merged.
- One projection every head shares, applied after the split: `Linear(d_head, d_head)` on `[b, n, h, d]`, on
  `[b, h, n, d]` with a bias, an einsum of one `[d, d]` weight, an einsum of one block per head.
- A projection computed and never used, the pattern multiplying the keys: with an output projection, without one,
  and with `nn.Parameter` weights.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def _grown(module, seed):
    """Move every weight off its initial value, as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)


# --- 1. heads computed one at a time ---------------------------------------------------------------


class CausalHead(nn.Module):
    """A book's single-head causal attention: a triu buffer masked in place, the scores scaled after the mask."""

    def __init__(self, d_in, d_out, context_length, bug=None):
        super().__init__()
        self.bug = bug
        self.W_query = nn.Linear(d_in, d_out, bias=True)
        self.W_key = nn.Linear(d_in, d_out, bias=True)
        self.W_value = nn.Linear(d_in, d_out, bias=True)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys, queries, values = self.W_key(x), self.W_query(x), self.W_value(x)
        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        scale = d_in ** 0.5 if self.bug == "scale_d_in" else keys.shape[-1] ** 0.5
        attn_weights = torch.softmax(attn_scores / scale, dim=1 if self.bug == "softmax_dim1" else -1)
        return attn_weights @ values


class CausalHeadsWrapper(nn.Module):
    """Heads as a ModuleList of single-head modules, their outputs concatenated and returned: no output projection,
    4 heads of 6 on a width of 32 (the merge narrower than the input)."""

    def __init__(self, d_in=32, d_out=6, context_length=16, num_heads=4, bug=None):
        super().__init__()
        self.heads = nn.ModuleList([CausalHead(d_in, d_out, context_length, bug) for _ in range(num_heads)])
        _grown(self, 1)

    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=-1)


class Head(nn.Module):
    """A video's `Head`: key, query, value Linear layers without bias, a tril buffer, dropout on the weights."""

    def __init__(self, n_embd, head_size, block_size, bug=None):
        super().__init__()
        self.bug = bug
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        B, T, C = x.shape
        k = self.key(x)
        q = self.query(x)
        wei = q @ k.transpose(-2, -1) * (C if self.bug == "scale_C" else k.shape[-1]) ** -0.5
        if self.bug == "mask_after":
            wei = F.softmax(wei, dim=-1).masked_fill(self.tril[:T, :T] == 0, 0.0)
        else:
            wei = F.softmax(wei.masked_fill(self.tril[:T, :T] == 0, float("-inf")), dim=-1)
        wei = self.dropout(wei)
        v = self.key(x) if self.bug == "values_from_keys" else self.value(x)
        return wei @ v


class HeadList(nn.Module):
    """A video's `MultiHeadAttention`: a ModuleList of `Head`, concatenated, then `proj` and dropout, or (`proj=False`)
    the concatenation returned as it is."""

    def __init__(self, n_embd=32, num_heads=4, head_size=8, block_size=16, proj=True, bug=None):
        super().__init__()
        self.heads = nn.ModuleList([Head(n_embd, head_size, block_size, bug) for _ in range(num_heads)])
        self.proj = nn.Linear(head_size * num_heads, n_embd) if proj else None
        self.dropout = nn.Dropout(0.1)
        _grown(self, 2)

    def forward(self, x):
        out = torch.cat([h(x) for h in self.heads], dim=-1)
        return self.dropout(self.proj(out)) if self.proj is not None else out


class WeightList(nn.Module):
    """A course's per-head weight matrices, `x @ W_q[h]` for each head (nn.ParameterList), the heads' outputs
    stacked `[b, h, n, d]` and merged by transpose and reshape; no output projection."""

    def __init__(self, d_model=32, n_heads=4, d_head=8, bug=None):
        super().__init__()
        self.n_heads, self.bug = n_heads, bug
        self.W_q = nn.ParameterList([nn.Parameter(torch.randn(d_model, d_head) / d_model ** 0.5)
                                     for _ in range(n_heads)])
        self.W_k = nn.ParameterList([nn.Parameter(torch.randn(d_model, d_head) / d_model ** 0.5)
                                     for _ in range(n_heads)])
        self.W_v = nn.ParameterList([nn.Parameter(torch.randn(d_model, d_head) / d_model ** 0.5)
                                     for _ in range(n_heads)])
        _grown(self, 3)

    def forward(self, x):
        b, n, _ = x.shape
        outs = []
        for h in range(self.n_heads):
            q, k, v = x @ self.W_q[h], x @ self.W_k[h], x @ self.W_v[h]
            if self.bug == "kv_swapped":
                k, v = v, k
            scores = q @ k.transpose(-2, -1)
            if self.bug != "scale_none":
                scores = scores / math.sqrt(q.shape[-1])
            outs.append(torch.softmax(scores, dim=-1) @ v)
        stacked = torch.stack(outs, dim=1)  # [b, h, n, d]
        if self.bug == "merge_no_transpose":
            return stacked.reshape(b, n, -1)
        return stacked.transpose(1, 2).reshape(b, n, -1)


# --- 2. one projection every head shares, after the split -------------------------------------------


class SharedHeadLinear(nn.Module):
    """A 2020 tutorial's self-attention: the input cut in heads first, then one `Linear(d_head, d_head)` per role
    that every head shares, scores by matmul over `[b, h, n, d]`, an output projection."""

    def __init__(self, embed_size=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.head_dim, self.bug = heads, embed_size // heads, bug
        self.values = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.keys = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.queries = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.fc_out = nn.Linear(embed_size, embed_size)
        _grown(self, 4)

    def forward(self, x):
        b, n, _ = x.shape
        parts = x.reshape(b, n, self.heads, self.head_dim)
        q = self.queries(parts).transpose(1, 2)  # [b, h, n, d]
        k = self.keys(parts).transpose(1, 2)
        v = self.values(parts).transpose(1, 2)
        if self.bug == "kv_swapped":
            k, v = v, k
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if self.bug == "softmax_dim2":
            out = torch.softmax(scores, dim=2) @ v
        else:
            out = torch.softmax(scores, dim=-1) @ v
        merged = out.reshape(b, n, -1) if self.bug == "merge_no_transpose" else out.transpose(1, 2).reshape(b, n, -1)
        return self.fc_out(merged)


class SharedHeadsFirst(nn.Module):
    """The heads split and moved first (`[b, h, n, d]`), then shared biased Linear layers; SDPA; `o` on the merge."""

    def __init__(self, dim=32, num_heads=4, bug=None):
        super().__init__()
        self.h, self.bug = num_heads, bug
        d = dim // num_heads
        self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))
        self.o = nn.Linear(dim, dim)
        _grown(self, 5)

    def forward(self, x):
        b, n, dim = x.shape
        heads = x.view(b, n, self.h, dim // self.h).transpose(1, 2)  # [b, h, n, d]
        q, k, v = self.q(heads), self.k(heads), self.v(heads)
        scale = 1.0 / dim ** 0.5 if self.bug == "scale_dim" else None
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self.o(out.transpose(1, 2).reshape(b, n, dim))


class SharedEinsum(nn.Module):
    """One `[d, d]` weight per role every head shares, written as einsums over `'bnhd'`; the output projection an
    `nn.Parameter` too."""

    def __init__(self, d_model=32, n_head=4, bug=None):
        super().__init__()
        self.h, self.bug = n_head, bug
        d = d_model // n_head
        self.w_q, self.w_k, self.w_v = (nn.Parameter(torch.randn(d, d) / d ** 0.5) for _ in range(3))
        self.w_o = nn.Parameter(torch.randn(d_model, d_model) / d_model ** 0.5)
        _grown(self, 6)

    def forward(self, x):
        b, n, d_model = x.shape
        xh = x.view(b, n, self.h, -1)
        q = torch.einsum("bnhd,de->bnhe", xh, self.w_q)
        k = torch.einsum("bnhd,de->bnhe", xh, self.w_k)
        v = torch.einsum("bnhd,de->bnhe", xh, self.w_v)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k)
        if self.bug != "scale_none":
            scores = scores / math.sqrt(q.shape[-1])
        pattern = scores.softmax(dim=-1)
        if self.bug == "values_from_keys":
            v = k
        out = torch.einsum("bhqk,bkhd->bqhd", pattern, v).reshape(b, n, d_model)
        return out @ self.w_o


class BlockEinsum(nn.Module):
    """One block per head, `[n_head, d, d]`, applied to each head's slice (`'bhnd,hde->bhne'`) after the split; no
    output projection: the merged heads are returned."""

    def __init__(self, d_model=32, n_head=4, bug=None):
        super().__init__()
        self.h, self.bug = n_head, bug
        d = d_model // n_head
        self.wq, self.wk, self.wv = (nn.Parameter(torch.randn(n_head, d, d) / d ** 0.5) for _ in range(3))
        _grown(self, 7)

    def forward(self, x):
        b, n, d_model = x.shape
        xh = x.view(b, n, self.h, -1).permute(0, 2, 1, 3)  # [b, h, n, d]
        q = torch.einsum("bhnd,hde->bhne", xh, self.wq)
        k = torch.einsum("bhnd,hde->bhne", xh, self.wk)
        v = torch.einsum("bhnd,hde->bhne", xh, self.wv)
        if self.bug == "kv_swapped":
            k, v = v, k
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        out = scores.softmax(-1) @ v
        return out.permute(0, 2, 1, 3).reshape(b, n, d_model)


# --- 3. a projection computed and never used ---------------------------------------------------------


class ValueThrownAway(nn.Module):
    """A paper port's attention taking `[q, k, v]` as a list (its decoder calls it on `[x, x, x]` with a look-ahead
    mask, 1 = masked): Wq, Wk, Wv, fc; the values' projection computed, and (`values_from_keys`) the pattern
    multiplying the keys instead."""

    def __init__(self, h=4, d=32, bug=None):
        super().__init__()
        self.h, self.d, self.bug = h, d, bug
        self.Wq, self.Wk, self.Wv = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.fc = nn.Linear(d, d)
        _grown(self, 8)

    def forward(self, x):
        n = x.shape[1]
        return self.attend([x, x, x], torch.triu(torch.ones(n, n), diagonal=1))[0]

    def attend(self, inputs, mask):
        q = self.Wq(inputs[0]).reshape(inputs[0].size(0), inputs[0].size(1), self.h, -1).permute(0, 2, 1, 3)
        k = self.Wk(inputs[1]).reshape(inputs[1].size(0), inputs[1].size(1), self.h, -1).permute(0, 2, 1, 3)
        v = self.Wv(inputs[2]).reshape(inputs[2].size(0), inputs[2].size(1), self.h, -1).permute(0, 2, 1, 3)
        logits = torch.matmul(q, k.permute(0, 1, 3, 2)) / math.sqrt(self.d // self.h)
        logits = logits + mask.to(logits.dtype) * -1e9
        weights = F.softmax(logits, -1)
        out = torch.matmul(weights, k if self.bug == "values_from_keys" else v)
        return self.fc(out.permute(0, 2, 1, 3).reshape(out.size(0), -1, self.d)), weights


class SelfOnlyValueThrownAway(nn.Module):
    """An encoder's self-attention without an output projection (its block's own holds it): the value layer
    computed, and (`values_from_keys`) the context made from the key layer."""

    def __init__(self, hidden_size=32, num_attention_heads=4, bug=None):
        super().__init__()
        self.h, self.d, self.bug = num_attention_heads, hidden_size // num_attention_heads, bug
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        _grown(self, 9)

    def split(self, t):
        return t.view(t.shape[0], t.shape[1], self.h, self.d).permute(0, 2, 1, 3)

    def forward(self, hidden_states):
        query_layer = self.split(self.query(hidden_states))
        key_layer = self.split(self.key(hidden_states))
        value_layer = self.split(self.value(hidden_states))
        scores = torch.matmul(query_layer, key_layer.transpose(-1, -2)) / math.sqrt(self.d)
        probs = nn.functional.softmax(scores, dim=-1)
        context = torch.matmul(probs, key_layer if self.bug == "values_from_keys" else value_layer)
        context = context.permute(0, 2, 1, 3).contiguous()
        return context.view(context.shape[0], context.shape[1], -1)


class ParamsThrownAway(nn.Module):
    """`nn.Parameter` weights used as `X @ W`: W_V's product computed, and (`values_from_keys`) the pattern
    multiplying the keys' product; W_O on the merge."""

    def __init__(self, d_model=32, n_heads=4, bug=None):
        super().__init__()
        self.h, self.bug = n_heads, bug
        self.W_Q, self.W_K, self.W_V, self.W_O = (nn.Parameter(torch.randn(d_model, d_model) / d_model ** 0.5)
                                                  for _ in range(4))
        _grown(self, 10)

    def forward(self, X):
        b, n, d_model = X.shape
        Q = (X @ self.W_Q).view(b, n, self.h, -1).transpose(1, 2)
        K = (X @ self.W_K).view(b, n, self.h, -1).transpose(1, 2)
        V = (X @ self.W_V).view(b, n, self.h, -1).transpose(1, 2)
        P = torch.softmax(Q @ K.transpose(-2, -1) / math.sqrt(d_model // self.h), dim=-1)
        Z = P @ (K if self.bug == "values_from_keys" else V)
        return Z.transpose(1, 2).reshape(b, n, d_model) @ self.W_O
