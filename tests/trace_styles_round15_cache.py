"""Round 15's preallocated caches, in styles of our own: a forward that takes its cache as a parameter, a buffer as
long as every position it may hold, writes the new keys and values into it at the positions it is given (the
new tokens' indices) and attends to it whole; it cannot run with its cache None. Each class takes `bug=` to plant
one mistake; None is the correct code."""

import torch
import torch.nn.functional as F
from torch import nn


def split(t, h):
    return t.unflatten(-1, (h, -1)).transpose(1, 2)  # [B, n, h·d] -> [B, h, n, d]


def merge(t):
    return t.transpose(1, 2).flatten(2)  # [B, h, n, d] -> [B, n, h·d]


class Linear(nn.Module):
    """gemma_pytorch's own Linear: a weight Parameter and F.linear, no nn.Linear (so nothing says the key/value heads
    of its fused projection before a run)."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) * in_features ** -0.5)

    def forward(self, x):
        return F.linear(x, self.weight)


class GemmaCache(nn.Module):
    """gemma_pytorch-like: a fused qkv_proj (its own Linear) for 4 query heads and 2 key/value heads, the cache a pair
    [n_batch, max_len, n_kv_head, d_head] written by `index_copy_(1, kv_write_indices, xk)` and read whole,
    repeat_interleave, the additive mask added. bug "tiled": the key/value heads tiled."""

    def __init__(self, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, bug=None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.bug = num_heads, num_kv_heads, head_dim, bug
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, hidden_size)

    def forward(self, hidden_states, kv_write_indices, kv_cache, mask):
        batch_size, input_len, _ = hidden_states.shape
        xq, xk, xv = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        xq = xq.view(batch_size, -1, self.num_heads, self.head_dim)
        xk = xk.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xv = xv.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(1, kv_write_indices, xk)  # [B, max_len, n_kv_head, d_head]
        v_cache.index_copy_(1, kv_write_indices, xv)
        group = self.num_heads // self.num_kv_heads
        if self.bug == "tiled":
            key, value = k_cache.repeat(1, 1, group, 1), v_cache.repeat(1, 1, group, 1)
        else:
            key, value = (torch.repeat_interleave(t, group, dim=2) for t in (k_cache, v_cache))
        q, k, v = xq.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        scores = torch.matmul(q * self.head_dim ** -0.5, k.transpose(2, 3)) + mask
        output = torch.matmul(F.softmax(scores.float(), dim=-1).type_as(q), v)
        return self.o_proj(output.transpose(1, 2).contiguous().view(batch_size, input_len, -1))


class FastCache(nn.Module):
    """gpt-fast-like: the keys' and the values' caches as two parameters [n_batch, n_head, max_len, d_head], written
    by slice assignment at `input_pos` (`k_cache[:, :, input_pos] = k`), SDPA over the whole cache with a boolean
    mask. bug "scale_twice": q scaled before SDPA scales it again."""

    def __init__(self, dim=32, n_head=4, bug=None):
        super().__init__()
        self.n_head, self.bug = n_head, bug
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, input_pos, k_cache, v_cache, mask):
        q, k, v = (split(t, self.n_head) for t in self.wqkv(x).split(x.shape[-1], dim=-1))
        k_cache[:, :, input_pos] = k
        v_cache[:, :, input_pos] = v
        if self.bug == "scale_twice":
            q = q * q.shape[-1] ** -0.5
        y = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)
        return self.wo(merge(y))


class SlotCache(nn.Module):
    """A multi-query attention whose cache is a pair [n_batch, 1, max_len, d_head] written at `positions` by
    index_copy_ on the positions' axis, the one key/value head broadcast over the query heads, a boolean attn_mask
    applied by masked_fill. bug "scale_d_head": the scores divided by d_head."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.head_dim = embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.kv_proj = nn.Linear(embed_dim, 2 * self.head_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, hidden_states, positions, kv_cache, attn_mask=None):
        q = split(self.q_proj(hidden_states), self.num_heads)  # [B, h, n, d]
        k, v = (t[:, None] for t in self.kv_proj(hidden_states).chunk(2, dim=-1))  # [B, 1, n, d]
        cache_k, cache_v = kv_cache
        cache_k.index_copy_(2, positions, k)
        cache_v.index_copy_(2, positions, v)
        scale = self.head_dim ** (-1.0 if self.bug == "scale_d_head" else -0.5)
        scores = (q @ cache_k.transpose(-1, -2)) * scale  # the one key/value head broadcast over the heads
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        return self.out_proj(merge(scores.softmax(-1) @ cache_v))


class SlotMapped(nn.Module):
    """vLLM-like: the cache written at a `slot_mapping` no word of trace's reads as positions, beside the cache; a
    decode step cannot be fed (a refusal that says what to do, never 'takes none')."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, hidden_states, slot_mapping, kv_cache):
        q, k, v = (split(t, self.heads) for t in self.qkv(hidden_states).chunk(3, dim=-1))
        kv_cache[0].index_copy_(2, slot_mapping, k)
        kv_cache[1].index_copy_(2, slot_mapping, v)
        return merge(F.scaled_dot_product_attention(q, kv_cache[0], kv_cache[1]))
