"""Styles of our own for masks built or fed in the idioms of real libraries (tests/test_trace_round20_masks.py):
DistilBERT's `(mask == 0).view(..).expand_as(scores)` filled with finfo.min, BART's 4-D additive mask added to the
scores viewed [bsz, heads, tgt, src] and folded back to [bsz·heads, ..], Llama 4's chunked local attention built in
the module, a Mistral/Gemma 3-like decode step whose sliding window is a boolean mask built from cache_position, and
a module whose window is optional. `bug` plants one mistake each."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module: nn.Module, seed: int) -> None:
    """Weights moved off their initial values, biases not zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


class DistilSelfAttention(nn.Module):
    """DistilBERT's MultiHeadSelfAttention, shrunk: forward(query, key, value, mask), mask [bs, k_len] with
    1 = a real token, turned into `(mask == 0)` over the scores and filled with the dtype's smallest number."""

    def __init__(self, dim=32, n_heads=4, bug=None):
        super().__init__()
        self.n_heads, self.dim, self.bug = n_heads, dim, bug
        self.q_lin, self.k_lin = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_lin, self.out_lin = nn.Linear(dim, dim), nn.Linear(dim, dim)
        _trained(self, 1)

    def forward(self, query, key, value, mask):
        bs, q_length, dim = query.size()
        k_length = key.size(1)
        dim_per_head = self.dim // self.n_heads
        mask_reshp = (bs, 1, 1, k_length)

        def shape(x):
            return x.view(bs, -1, self.n_heads, dim_per_head).transpose(1, 2)

        q = shape(self.q_lin(query)) / math.sqrt(dim_per_head)
        k, v = shape(self.k_lin(key)), shape(self.v_lin(value))
        scores = torch.matmul(q, k.transpose(2, 3))
        if self.bug == "on_queries":
            mask = (mask == 0).view(bs, 1, k_length, 1).expand_as(scores)
        elif self.bug == "polarity":
            mask = (mask == 1).view(mask_reshp).expand_as(scores)
        else:
            mask = (mask == 0).view(mask_reshp).expand_as(scores)
        fill = 0.0 if self.bug == "filled_with_0" else torch.finfo(scores.dtype).min
        if self.bug == "after_softmax":
            weights = nn.functional.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            weights = nn.functional.softmax(scores.masked_fill(mask, fill), dim=-1)
        context = torch.matmul(weights, v).transpose(1, 2).reshape(bs, -1, self.n_heads * dim_per_head)
        return self.out_lin(context)


class BartAttention(nn.Module):
    """BART's eager attention, shrunk: queries scaled before the product, heads folded into the batch
    [bsz·heads, tgt, d_head], bmm, the 4-D additive attention_mask [bsz, 1, tgt, src] added to the scores viewed
    [bsz, heads, tgt, src], then folded back."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.bug = embed_dim, num_heads, bug
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj, self.v_proj = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)
        self.q_proj, self.out_proj = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)
        _trained(self, 2)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask=None):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states, value_states = key_states.reshape(*proj_shape), value_states.reshape(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            if self.bug == "transposed":
                attention_mask = attention_mask.transpose(-1, -2)
            weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            if self.bug == "added_after":
                weights = nn.functional.softmax(weights, dim=-1) + attention_mask
            else:
                weights = weights + attention_mask
            attn_weights = weights.view(bsz * self.num_heads, tgt_len, src_len)
        if self.bug != "added_after":
            attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        return self.out_proj(attn_output.reshape(bsz, tgt_len, self.embed_dim))


def chunked_mask(n: int, chunk: int, bug: str | None = None) -> torch.Tensor:
    """Llama 4's chunked local attention, True = may attend: key j for query i where both lie in one chunk of
    `chunk` positions and j <= i."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    same = (i // chunk) == (j // chunk)
    if bug == "chunk_boundary":
        same = ((i + 1) // chunk) == ((j + 1) // chunk)
    causal = j <= i
    if bug == "off_by_one":
        causal = j <= i + 1
    elif bug == "transposed":
        causal = j >= i
    return same & causal


class ChunkedLocalAttention(nn.Module):
    """A Llama 4-like local layer: attention_chunk_size read from the config, the chunked causal mask built in the
    module from the positions (no mask parameter), grouped K/V heads, SDPA with the boolean mask."""

    def __init__(self, hidden_size=32, num_heads=4, num_kv_heads=2, attention_chunk_size=3, bug=None):
        super().__init__()
        self.h, self.kvh, self.d, self.chunk, self.bug = (num_heads, num_kv_heads, hidden_size // num_heads,
                                                          attention_chunk_size, bug)
        self.q_proj = nn.Linear(hidden_size, num_heads * self.d, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.d, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.d, bias=False)
        self.o_proj = nn.Linear(num_heads * self.d, hidden_size, bias=False)
        _trained(self, 3)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, self.h, self.d).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, n, self.kvh, self.d).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, n, self.kvh, self.d).transpose(1, 2)
        k = k.repeat_interleave(self.h // self.kvh, dim=1)
        v = v.repeat_interleave(self.h // self.kvh, dim=1)
        allowed = chunked_mask(n, self.chunk, self.bug)
        scores = q @ k.transpose(-1, -2) * self.d ** -0.5
        if self.bug == "after_softmax":
            weights = scores.softmax(-1) * allowed
        elif self.bug == "filled_with_0":
            weights = scores.masked_fill(~allowed, 0.0).softmax(-1)
        else:
            weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out = (weights @ v).transpose(1, 2).reshape(b, n, -1)
        return self.o_proj(out)


class WindowDecode(nn.Module):
    """A Mistral/Gemma 3-like decode step: forward(hidden_states, past_key_value=None, cache_position=None), the cache
    (k, v) [b, kvh, n_past, d] joined on the sequence axis, the sliding window built as a boolean mask from
    cache_position (the new queries' positions) and the keys' positions, SDPA with it."""

    def __init__(self, hidden_size=32, num_heads=4, num_kv_heads=2, sliding_window=3, bug=None):
        super().__init__()
        self.h, self.kvh, self.d, self.window, self.bug = (num_heads, num_kv_heads, hidden_size // num_heads,
                                                           sliding_window, bug)
        self.q_proj = nn.Linear(hidden_size, num_heads * self.d)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.d)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.d)
        self.o_proj = nn.Linear(num_heads * self.d, hidden_size, bias=False)
        _trained(self, 4)

    def forward(self, hidden_states, past_key_value=None, cache_position=None):
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, self.h, self.d).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, n, self.kvh, self.d).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, n, self.kvh, self.d).transpose(1, 2)
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        n_past = k.shape[2] - n
        if cache_position is None:
            cache_position = torch.arange(n_past, n_past + n)
        if self.bug == "upper_left":
            cache_position = torch.arange(n)
        kv_pos = torch.arange(k.shape[2])
        causal = kv_pos[None, :] <= cache_position[:, None]
        if self.bug == "window_off_by_one":
            band = kv_pos[None, :] >= cache_position[:, None] - self.window
        else:
            band = kv_pos[None, :] > cache_position[:, None] - self.window
        if self.bug == "transposed":
            causal = kv_pos[None, :] >= cache_position[:, None]
            band = kv_pos[None, :] < cache_position[:, None] + self.window
        mask = causal & band
        if self.bug == "polarity":
            mask = ~mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class OptionalWindow(nn.Module):
    """A module whose window is optional: causal by itself, forward(x, attention_mask=None, use_sliding_window=False)
    also masks keys `window` or more positions back when use_sliding_window is True; attention_mask is a [b, n]
    padding mask, 1 = a real token."""

    def __init__(self, dim=32, n_heads=4, window=3, bug=None):
        super().__init__()
        self.h, self.d, self.window, self.bug = n_heads, dim // n_heads, window, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        _trained(self, 5)

    def forward(self, x, attention_mask=None, use_sliding_window=False):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        allowed = j <= i
        if use_sliding_window:
            allowed = allowed & (i - j < self.window + (1 if self.bug == "window_off_by_one" else 0))
        if self.bug == "transposed":
            allowed = allowed.T
        allowed = allowed[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.d)
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        out = scores.softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


class PaddedEncoderLayer(nn.Module):
    """A fairseq-like self-attention: forward(x, attn_mask=None, key_padding_mask=None); the causal rule comes as a
    float attn_mask [tgt, src] added to the scores, the padding as key_padding_mask [bsz, src].

    key_padding_mask: True marks a padding key, which no query may attend to."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.h, self.d, self.bug = num_heads, embed_dim // num_heads, bug
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        _trained(self, 6)

    def forward(self, x, attn_mask=None, key_padding_mask=None):
        b, n, _ = x.shape
        q, k, v = self.in_proj(x).view(b, n, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) * self.d ** -0.5
        if attn_mask is not None:
            scores = scores + attn_mask
        if key_padding_mask is not None:
            pad = ~key_padding_mask if self.bug == "polarity" else key_padding_mask
            scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        out = scores.softmax(-1) @ v
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class BufferCausal(nn.Module):
    """A GPT-2-like layer: its own causal buffer `bias` [1, 1, max, max] applied with torch.where and
    finfo.min, then the caller's additive attention_mask (key padding, 0 / finfo.min) added."""

    def __init__(self, n_embd=32, n_head=4, n_positions=16, bug=None):
        super().__init__()
        self.h, self.d, self.bug = n_head, n_embd // n_head, bug
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(n_positions, n_positions, dtype=torch.bool))[None, None])
        _trained(self, 7)

    def forward(self, hidden_states, attention_mask=None):
        b, n, c = hidden_states.shape
        q, k, v = (t.view(b, n, self.h, self.d).transpose(1, 2) for t in self.c_attn(hidden_states).split(c, dim=2))
        w = q @ k.transpose(-1, -2) / (self.d ** 0.5)
        causal_mask = self.bias[:, :, :n, :n]
        if self.bug == "transposed":
            causal_mask = causal_mask.transpose(-1, -2)
        w = torch.where(causal_mask, w, torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype))
        if attention_mask is not None:
            w = w + attention_mask
        w = w.softmax(-1)
        return self.c_proj((w @ v).transpose(1, 2).reshape(b, n, c))
