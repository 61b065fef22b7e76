"""Round 24's decode steps whose rotary needs position ids that default to None (`position_ids=None`): trace runs
them given arange(n_cache, n_cache + n)[None] together with the cache layout the code keeps. Each builds its rotary
from `position_ids.shape` or its values and raises on None.

- `HfCacheStep`: HF Llama / OLMoE's decode path: `past_key_value.update(k, v, self.layer_idx)` (a DynamicCache),
  GQA by repeat_interleave, an additive mask it is handed (sliced to the keys).
- `TupleCacheStep`: GPT-NeoX-like: `layer_past=(k, v)` joined with torch.cat, the present returned, a causal mask it
  makes itself from the positions.
- `FunctionalStep`: a functional body (F.linear on the module's weights, RoPE as complex products with torch.polar)
  taking `kv_cache=(k, v)` and `position_ids=None`, SDPA with a boolean mask it makes itself.
Plants: `positions` (the rotary at 0..n-1 whatever the ids say: rope.positions).
"""

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


def _half_turn(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cos_sin(position_ids: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = position_ids[:, :, None].float() * inv_freq[None, None, :]  # [b, n, d/2]
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos()[:, None], emb.sin()[:, None]


class HfCacheStep(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, num_key_value_heads=2, layer_idx=0, bug=None):
        super().__init__()
        self.h, self.kv, self.d, self.layer_idx, self.bug = num_heads, num_key_value_heads, hidden_size // num_heads, \
            layer_idx, bug
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=True)
        self.k_proj = nn.Linear(hidden_size, self.kv * self.d, bias=True)
        self.v_proj = nn.Linear(hidden_size, self.kv * self.d, bias=True)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        _trained(self, 11)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, cache_position=None):
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, self.h, self.d).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, n, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, n, self.kv, self.d).transpose(1, 2)
        at = torch.arange(n)[None].expand(position_ids.shape[0], -1) if self.bug == "positions" else position_ids
        cos, sin = _cos_sin(at, self.d)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = q * cos + _half_turn(q) * sin, k * cos + _half_turn(k) * sin
        if past_key_value is not None:
            k, v = past_key_value.update(k, v, self.layer_idx, {"cos": cos, "sin": sin})
        k = k.repeat_interleave(self.h // self.kv, dim=1)
        v = v.repeat_interleave(self.h // self.kv, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        if attention_mask is not None:
            scores = scores + attention_mask[:, :, :, : k.shape[-2]]
        out = scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1)), past_key_value


class TupleCacheStep(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4, bug=None):
        super().__init__()
        self.h, self.d, self.bug = num_attention_heads, hidden_size // num_attention_heads, bug
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        _trained(self, 12)

    def forward(self, hidden_states, layer_past=None, position_ids=None):
        b, n, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(b, n, self.h, 3 * self.d).permute(0, 2, 1, 3)
        q, k, v = qkv[..., : self.d], qkv[..., self.d: 2 * self.d], qkv[..., 2 * self.d:]
        at = torch.arange(n)[None] if self.bug == "positions" else position_ids
        cos, sin = _cos_sin(at, self.d)
        q, k = q * cos + _half_turn(q) * sin, k * cos + _half_turn(k) * sin
        if layer_past is not None:
            k, v = torch.cat((layer_past[0], k), dim=-2), torch.cat((layer_past[1], v), dim=-2)
        present = (k, v)
        n_k = k.shape[-2]
        causal = torch.ones(n, n_k, dtype=torch.bool).tril(n_k - n)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.d)
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        out = torch.matmul(F.softmax(scores, dim=-1), v)
        return self.dense(out.permute(0, 2, 1, 3).reshape(b, n, -1)), present


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE as complex products, coordinate i paired with i + d/2."""
    d = x.shape[-1]
    angle = positions[0].double()[:, None] * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    turn = torch.polar(torch.ones_like(angle), angle)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double()) * turn
    return torch.cat((z.real, z.imag), -1).to(x.dtype)


def attend(x, weights, kv, position_ids, n_head, turned_at=None):
    """One decode step's attention, functional: the projections, RoPE at `position_ids` (`turned_at` where given:
    the plant), the cache joined, each query seeing the keys up to its position."""
    q, k, v = (F.linear(x, w, bias).unflatten(-1, (n_head, -1)).transpose(1, 2) for w, bias in weights[:3])
    at = position_ids if turned_at is None else turned_at
    q, k = _rotate(q, at), _rotate(k, at)
    if kv is not None:
        k, v = torch.cat([kv[0], k], 2), torch.cat([kv[1], v], 2)
    seen = torch.arange(k.shape[2])[None, :] <= position_ids[0][:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=seen)
    return F.linear(out.transpose(1, 2).flatten(2), *weights[3])


class FunctionalStep(nn.Module):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))
        _trained(self, 13)

    def forward(self, x, kv_cache=None, position_ids=None):
        weights = [(w.weight, w.bias) for w in (self.wq, self.wk, self.wv, self.wo)]
        n = position_ids.shape[-1]  # raises on None: the positions are the caller's
        turned_at = torch.arange(n)[None] if self.bug == "positions" else None
        return attend(x, weights, kv_cache, position_ids, self.heads, turned_at)
