"""Styles of our own whose RoPE reads an optional position argument that transformers' model always passes
(tests/test_trace_round23_positions.py): a Griffin-like layer whose rotary takes `position_ids.shape[0]`, a
Llama-like attention with its own rotary module and `position_ids=None`, and a decode step joined to its cache that
rotates its new tokens at `positions`. `bug` plants one mistake each."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module: nn.Module, seed: int) -> None:
    """Weights moved off their initial values, biases not zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def tables(position_ids: torch.Tensor, d: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary: cos, sin [b, n, d] of the angles position · base^(-2i/d), halves repeated."""
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = (inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1) @ position_ids[:, None, :].double())
    emb = torch.cat((freqs, freqs), dim=1).transpose(1, 2)
    return emb.cos(), emb.sin()


class GriffinLike(nn.Module):
    """forward(hidden_states, position_ids=None, attention_mask=None, cache_position=None, use_cache=False): one
    key/value head, the rotary built from position_ids with no default of its own, causal SDPA."""

    def __init__(self, hidden_size=32, num_heads=4, bug=None):
        super().__init__()
        self.h, self.d, self.bug = num_heads, hidden_size // num_heads, bug
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.d, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.d, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=True)
        _trained(self, 1)

    def forward(self, hidden_states, position_ids=None, attention_mask=None, cache_position=None, use_cache=False):
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, self.h, self.d).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, n, 1, self.d).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, n, 1, self.d).transpose(1, 2)
        cos, sin = tables(position_ids, self.d, 1000.0 if self.bug == "base" else 10000.0)
        cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.expand(b, self.h, n, self.d), v.expand(b, self.h, n, self.d)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class RotaryEmbedding(nn.Module):
    """transformers' LlamaRotaryEmbedding: forward(x, position_ids) -> (cos, sin)."""

    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim, self.base = dim, base

    def forward(self, x, position_ids):
        cos, sin = tables(position_ids, self.dim, self.base)
        return cos.to(x.dtype), sin.to(x.dtype)


class LlamaLike(nn.Module):
    """forward(hidden_states, attention_mask=None, position_ids=None): its own rotary module, grouped heads."""

    def __init__(self, hidden_size=32, num_heads=4, num_key_value_heads=2, rope_theta=10000.0, bug=None):
        super().__init__()
        self.h, self.kvh, self.d, self.bug = num_heads, num_key_value_heads, hidden_size // num_heads, bug
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * self.d)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * self.d)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(self.d, 1000000.0 if bug == "base" else rope_theta)
        _trained(self, 2)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, -1, self.d).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, n, -1, self.d).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, n, -1, self.d).transpose(1, 2)
        cos, sin = self.rotary_emb(v, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
        k = k.repeat_interleave(self.h // self.kvh, dim=1)
        v = v.repeat_interleave(self.h // self.kvh, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class DecodeStep(nn.Module):
    """A decode step: forward(x, past_key_value=None, pos_ids=None), the cache (k, v) [b, h, n_past, d] already
    rotated, joined on the sequence axis; the new tokens rotated at pos_ids (after the cached ones), each
    seeing the keys up to its own position."""

    def __init__(self, dim=32, n_heads=4, bug=None):
        super().__init__()
        self.h, self.d, self.bug = n_heads, dim // n_heads, bug
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        _trained(self, 3)

    def forward(self, x, past_key_value=None, pos_ids=None):
        b, n, _ = x.shape
        q, k, v = (w(x).view(b, n, self.h, self.d).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        at = torch.arange(n)[None] if self.bug == "positions" else pos_ids
        cos, sin = tables(at, self.d, 10000.0)
        cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if past_key_value is not None:
            k, v = torch.cat([past_key_value[0], k], 2), torch.cat([past_key_value[1], v], 2)
        mask = torch.arange(k.shape[2])[None, :] <= pos_ids[0][:, None]  # causal, the cached keys seen by all
        return self.wo(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, n, -1))


class OwnIds(nn.Module):
    """Qwen2-VL's way: forward(hidden_states, position_ids=None) makes its own multimodal ids [3, b, n] from None
    (text alone: the three sections' rows alike) and takes their first row; ids [1, n] would break it."""

    def __init__(self, hidden_size=32, num_heads=4, bug=None):
        super().__init__()
        self.h, self.d, self.bug = num_heads, hidden_size // num_heads, bug
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)
        _trained(self, 4)

    def forward(self, hidden_states, position_ids=None):
        b, n, _ = hidden_states.shape
        if position_ids is None:
            position_ids = torch.arange(n)[None, None].expand(3, b, n)
        q, k, v = self.qkv(hidden_states).view(b, n, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        cos, sin = tables(position_ids[0], self.d, 10000.0)
        cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))
