"""Styles of our own for three forms of round 16: modules that run on one sequence [n, d] (picoGPT's numpy port: heads
a list, `q @ k.T`, a mask of its own), and modules that keep state between calls (a cache they write, torchtune's
KVCache with its cache_pos moved by every call; a streaming offset counted by the module). Each takes `bug=` for a
plant; tests/test_trace_round16_state.py checks each against F.scaled_dot_product_attention in float64."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# --- one sequence [n, d] -------------------------------------------------------------------------------------------


def softmax(x):
    e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


class PicoHeads(nn.Module):
    """picoGPT's mha as a module: Parameters used as x @ w + b, the heads a list, the causal mask additive."""

    def __init__(self, n_embd=32, n_head=4, bug=None):
        super().__init__()
        self.n_head, self.bug = n_head, bug
        self.c_attn_w = nn.Parameter(torch.randn(n_embd, 3 * n_embd) * 0.2)
        self.c_attn_b = nn.Parameter(torch.randn(3 * n_embd) * 0.1)
        self.c_proj_w = nn.Parameter(torch.randn(n_embd, n_embd) * 0.2)
        self.c_proj_b = nn.Parameter(torch.randn(n_embd) * 0.1)

    def attention(self, q, k, v, mask):  # [n_q, d], [n_k, d], [n_k, d], [n_q, n_k] -> [n_q, d]
        scores = q @ k.T / math.sqrt(q.shape[-1])
        if self.bug == "mask_multiplied":
            return softmax(scores * mask) @ v
        return softmax(scores + mask) @ v

    def forward(self, x):  # [n_seq, n_embd] -> [n_seq, n_embd]
        x = x @ self.c_attn_w + self.c_attn_b  # [n_seq, 3 * n_embd]
        qkv = torch.split(x, x.shape[-1] // 3, dim=-1)
        heads = [torch.split(t, t.shape[-1] // self.n_head, dim=-1) for t in qkv]
        n = x.shape[0]
        if self.bug == "mask_multiplied":
            mask = torch.tril(torch.ones(n, n, dtype=x.dtype))
        else:
            mask = (1 - torch.tril(torch.ones(n, n, dtype=x.dtype))) * -1e10
        out = [self.attention(q, k, v, mask) for q, k, v in zip(*heads, strict=True)]
        return torch.hstack(out) @ self.c_proj_w + self.c_proj_b


class FlatHeads(nn.Module):
    """nn.Linear layers on one sequence, the heads split by view(n, h, d).transpose(0, 1)."""

    def __init__(self, d_model=32, n_head=4, bug=None):
        super().__init__()
        self.h, self.bug = n_head, bug
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, x):  # [n, d_model]
        n, d = x.shape
        q, k, v = (w(x).view(n, self.h, d // self.h).transpose(0, 1) for w in (self.q, self.k, self.v))  # [h, n, d_h]
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.h)  # [h, n, n]
        future = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=2 if self.bug == "off_by_one" else 1)
        attn = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out = attn @ v  # [h, n, d_h]
        if self.bug == "merge":
            return self.o(out.reshape(n, d))
        return self.o(out.transpose(0, 1).reshape(n, d))


class EinsumOneSequence(nn.Module):
    """One sequence through einsum strings, no mask: 'nhd,mhd->hnm'."""

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):  # [n, dim]
        n, dim = x.shape
        q, k, v = (t.reshape(n, self.heads, -1) for t in self.to_qkv(x).chunk(3, dim=-1))  # [n, h, d]
        sim = torch.einsum("nhd,mhd->hnm", q, k) * (dim // self.heads) ** -0.5
        attn = sim.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        out = torch.einsum("hnm,mhd->nhd", attn, v)
        return self.to_out(out.reshape(n, dim))


# --- state kept between calls --------------------------------------------------------------------------------------


class KVCache(nn.Module):
    """torchtune's: buffers [batch, n_kv_head, max_len, d_head] written at cache_pos, which each update moves on."""

    def __init__(self, batch_size, max_seq_len, num_kv_heads, head_dim):
        super().__init__()
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("cache_pos", torch.arange(0, max_seq_len), persistent=False)

    def update(self, k_val, v_val):
        seq_len = k_val.shape[2]
        assert (self.cache_pos[0] + seq_len) <= self.k_cache.shape[2]
        self.k_cache[:, :, self.cache_pos[:seq_len]] = k_val
        self.v_cache[:, :, self.cache_pos[:seq_len]] = v_val
        self.cache_pos.add_(seq_len)
        return self.k_cache, self.v_cache


class CachedAttention(nn.Module):
    """Causal self-attention with a KVCache set up for a batch of its own: every call writes its keys and values into
    the cache and attends over the positions filled so far (a prefill is a call on an empty cache)."""

    def __init__(self, embed_dim=32, num_heads=4, batch_size=2, max_seq_len=16, bug=None):
        super().__init__()
        self.h, self.d, self.bug = num_heads, embed_dim // num_heads, bug
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))
        self.kv_cache = KVCache(batch_size, max_seq_len, num_heads, self.d)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.h, self.d).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        start = int(self.kv_cache.cache_pos[0])
        k, v = self.kv_cache.update(k, v)
        k, v = k[:, :, :start + s], v[:, :, :start + s]
        scale = 1.0 if self.bug == "no_scale" else self.d ** -0.5
        causal = torch.ones(s, start + s, dtype=torch.bool).tril(start)  # query i sits at start + i
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scale)
        return self.output_proj(out.transpose(1, 2).reshape(b, s, -1))


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class StreamingRotary(nn.Module):
    """A streaming layer that counts the positions it has seen (AudioCraft's offset): its RoPE positions start at
    the count, which each call moves on; a first call starts at 0."""

    def __init__(self, dim=32, heads=4, base=10000.0, bug=None):
        super().__init__()
        self.h, self.bug = heads, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        d = dim // heads
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, d, 2).float() / d), persistent=False)
        self.offset = 0

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        t = torch.arange(self.offset, self.offset + n, dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if self.bug == "rope_on_values":
            v = v * cos + rotate_half(v) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        self.offset += n
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class CachedLayer(nn.Module):
    """torchtune's TransformerSelfAttentionLayer: a block that calls `self.attn` and says no head count of its own;
    its attention does (CachedAttention's `h`)."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.attn = CachedAttention(embed_dim, num_heads, bug=bug)

    def forward(self, x):
        return self.attn(x)
