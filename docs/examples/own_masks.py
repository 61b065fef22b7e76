"""A module's own masks and a cache it writes in place (docs/trace.md, "A module's own masks"): GPT-2's causal buffer
beside the attention_mask it takes, an ESM-like self-attention with no output projection, gemma_pytorch's local layer
(a band on both sides merged into the causal mask it is given, a cache written at kv_write_indices), and an
AudioCraft-like streaming attention that makes its own causal mask and runs only as self-attention. `bug=` plants
one mistake."""

import math

import torch
import torch.nn.functional as F
from torch import nn


def split(t, h):
    return t.unflatten(-1, (h, -1)).transpose(1, 2)  # [B, n, h·d] -> [B, h, n, d]


def merge(t):
    return t.transpose(1, 2).flatten(2)  # [B, h, n, d] -> [B, n, h·d]


class Gpt2Attention(nn.Module):
    """transformers' GPT-2: the causal buffer `bias` applied with torch.where, then the additive attention_mask. bug
    "after_softmax": the buffer applied to the weights after the softmax; "multiplied": the scores times the buffer
    (`w * causal`), its weights keeping no 0; "unapplied": the buffer sliced, the torch.where left out."""

    def __init__(self, n_embd=32, n_head=4, n_positions=16, bug=None):
        super().__init__()
        self.n_head, self.bug = n_head, bug
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(n_positions, n_positions, dtype=torch.bool))
                             .view(1, 1, n_positions, n_positions), persistent=False)

    def forward(self, hidden_states, attention_mask=None):
        q, k, v = (split(t, self.n_head) for t in self.c_attn(hidden_states).chunk(3, dim=-1))
        w = q @ k.transpose(-1, -2) / math.sqrt(v.shape[-1])
        causal = self.bias[:, :, :q.shape[-2], :k.shape[-2]]
        if self.bug == "multiplied":
            w = w * causal
        elif self.bug not in ("after_softmax", "unapplied"):
            w = torch.where(causal, w, torch.finfo(w.dtype).min)
        if attention_mask is not None:
            w = w + attention_mask
        w = F.softmax(w, dim=-1)
        if self.bug == "after_softmax":
            w = torch.where(causal, w, torch.zeros_like(w))
        return self.c_proj(merge(w @ v))


class EsmSelfAttention(nn.Module):
    """ESM's self-attention, no output projection: the extended additive attention_mask added to the scores. bug
    "after_softmax": added to the probabilities."""

    def __init__(self, hidden_size=32, num_attention_heads=4, bug=None):
        super().__init__()
        self.h, self.bug = num_attention_heads, bug
        self.query, self.key, self.value = (nn.Linear(hidden_size, hidden_size) for _ in range(3))

    def forward(self, hidden_states, attention_mask=None):
        q, k, v = (split(f(hidden_states), self.h) for f in (self.query, self.key, self.value))
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
        if attention_mask is not None and self.bug != "after_softmax":
            scores = scores + attention_mask
        probs = F.softmax(scores, dim=-1)
        if attention_mask is not None and self.bug == "after_softmax":
            probs = probs + attention_mask
        return (merge(probs @ v),)


class Linear(nn.Module):
    """gemma_pytorch's Linear: a weight and F.linear."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) * in_features ** -0.5)

    def forward(self, x):
        return F.linear(x, self.weight)


class GemmaLocalAttention(nn.Module):
    """gemma_pytorch's local sliding layer: a fused qkv_proj for 4 query heads and 2 key/value heads, the cache
    [n_batch, max_len, n_kv_head, d_head] written at kv_write_indices and read whole, the band
    `triu(ones, -W + 1) * tril(ones, W - 1)` merged into the causal mask it is given. bug "window": the band one key
    wider on the left."""

    def __init__(self, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, sliding_window_size=4, bug=None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window, self.bug = sliding_window_size, bug
        self.qkv_proj = Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim)
        self.o_proj = Linear(num_heads * head_dim, hidden_size)

    def forward(self, hidden_states, kv_write_indices, kv_cache, mask):
        b, n, _ = hidden_states.shape
        sizes = [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim]
        xq, xk, xv = self.qkv_proj(hidden_states).split(sizes, dim=-1)
        xk, xv = xk.view(b, n, self.num_kv_heads, self.head_dim), xv.view(b, n, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(1, kv_write_indices, xk)
        v_cache.index_copy_(1, kv_write_indices, xv)
        group = self.num_heads // self.num_kv_heads
        k, v = (torch.repeat_interleave(t, group, dim=2).transpose(1, 2) for t in (k_cache, v_cache))
        scores = torch.matmul(split(xq, self.num_heads) * self.head_dim ** -0.5, k.transpose(2, 3))
        all_ones = torch.ones_like(mask)
        lower = -self.window if self.bug == "window" else -self.window + 1
        band = torch.triu(all_ones, lower) * torch.tril(all_ones, self.window - 1)
        mask = torch.where(band == 1, mask, -2.3819763e38)
        return self.o_proj(merge(torch.matmul(F.softmax(scores + mask, dim=-1), v)))


class StreamingAttention(nn.Module):
    """AudioCraft's StreamingMultiheadAttention, shrunk: causal by itself (`assert attn_mask is None`, its own
    bias, no key padding), its self-attention asserting `query is key`. bug "off_by_one": one later key let
    through."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        in_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.in_proj_weight, self.in_proj_bias = in_proj.weight, in_proj.bias
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, key_padding_mask=None, attn_mask=None):
        assert attn_mask is None
        assert key_padding_mask is None
        assert query is key and value is key, "specialized implementation"
        delta = torch.arange(query.shape[1])[:, None] - torch.arange(key.shape[1])[None, :]
        valid = delta >= (-1 if self.bug == "off_by_one" else 0)
        bias = torch.where(valid, torch.zeros([]), torch.full([], float("-inf")))
        q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).unflatten(-1, (3, self.num_heads, -1)) \
            .unbind(dim=2)
        w = torch.softmax(torch.einsum("bthd,bkhd->bhtk", q / q.shape[-1] ** 0.5, k) + bias, dim=-1)
        return self.out_proj(torch.einsum("bhtk,bkhd->bthd", w, v).flatten(2)), None
