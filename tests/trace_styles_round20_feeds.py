"""Styles for tests/test_trace_round20_feeds.py (round 20's feeds): RoPE's whole table handed in one parameter in
another form than its name says (a complex table under `position_embeddings`, one a sequence or one for all; the
pair (cos, sin) under `freqs_cis`), and the values made by the key projection where the keys and values come from
inputs of their own (`forward(query, key, value)`), or each projection fed the other's input. `bug=` plants a
mistake."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _moved(module: nn.Module, seed: int) -> None:
    """Every weight off its initial value (trained-looking: no zero bias, no unit gain)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


def _turn_neighbours(x, table):
    """x [b, n, h, d] with neighbours (2i, 2i + 1) turned by the complex `table` [.., n, d / 2]."""
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * table).flatten(3).type_as(x)


class ComplexPerSequence(nn.Module):
    """A Llama 4-like layer: the complex table for each sequence, [b, n, d / 2], under a parameter annotated as a
    tuple; moved to the queries' device, broadcast over the heads; GQA by repeat_interleave."""

    def __init__(self, bug: str | None = None):
        super().__init__()
        self.bug, self.heads, self.kv, self.d = bug, 4, 2, 8
        self.q_proj = nn.Linear(32, 32, bias=False)
        self.k_proj = nn.Linear(32, 16, bias=False)
        self.v_proj = nn.Linear(32, 16, bias=False)
        self.o_proj = nn.Linear(32, 32, bias=False)
        _moved(self, 11)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]):
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, self.heads, self.d)
        k = self.k_proj(hidden_states).view(b, n, self.kv, self.d)
        v = self.v_proj(hidden_states).view(b, n, self.kv, self.d)
        if self.bug == "kv_swapped":
            k, v = v, k
        table = position_embeddings.to(q.device)[:, :, None, :]
        q, k = _turn_neighbours(q, table), _turn_neighbours(k, table)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        scale = 1.0 if self.bug == "scale_none" else 1 / math.sqrt(self.d)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class ComplexForAll(nn.Module):
    """Meta-like: one complex table for every sequence, [n, d / 2], under `position_embeddings` (no annotation),
    laid [1, n, 1, d / 2] by the code; scores by matmul, softmax in float32."""

    def __init__(self, bug: str | None = None):
        super().__init__()
        self.bug, self.heads, self.d = bug, 4, 8
        self.wq = nn.Linear(32, 32)
        self.wk = nn.Linear(32, 32)
        self.wv = nn.Linear(32, 32)
        self.wo = nn.Linear(32, 32)
        _moved(self, 12)

    def forward(self, x, position_embeddings):
        b, n, _ = x.shape
        q, k, v = (w(x).view(b, n, self.heads, self.d) for w in (self.wq, self.wk, self.wv))
        if self.bug == "kv_swapped":
            k, v = v, k
        table = position_embeddings.view(1, n, 1, self.d // 2)
        q, k = _turn_neighbours(q, table), _turn_neighbours(k, table)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        weights = scores.masked_fill(~causal, float("-inf")).float().softmax(-1).type_as(q)
        return self.wo((weights @ v).transpose(1, 2).reshape(b, n, -1))


class PairUnderFreqsCis(nn.Module):
    """A parameter named `freqs_cis` that takes the pair (cos, sin), each [b, n, d], unpacked as transformers' are,
    the halves turned (rotate_half); scores by einsum."""

    def __init__(self, bug: str | None = None):
        super().__init__()
        self.bug, self.heads, self.d = bug, 4, 8
        self.qkv = nn.Linear(32, 96)
        self.proj = nn.Linear(32, 32)
        _moved(self, 13)

    @staticmethod
    def _half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, x, freqs_cis):
        cos, sin = freqs_cis
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.d).permute(2, 0, 3, 1, 4)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + self._half(q) * sin
        k = k * cos + self._half(k) * sin
        scale = 1.0 if self.bug == "scale_none" else self.d ** -0.5
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(causal, torch.finfo(scores.dtype).min).softmax(-1)
        return self.proj(torch.einsum("bhqk,bhkd->bqhd", weights, v).reshape(b, n, -1))


def _fed(bug, key, value):
    """What the key projection and the value projection read: the key and value inputs, or one in the other's place
    (round 33's plants: 'inputs_swapped' `k_proj(value)` and `v_proj(key)`, 'keys_from_value' `k_proj(value)`,
    'values_from_key' `v_proj(key)`)."""
    return {"inputs_swapped": (value, key), "keys_from_value": (value, value),
            "values_from_key": (key, key)}.get(bug, (key, value))


class DistilLike(nn.Module):
    """DistilBERT-like: `forward(query, key, value, mask)`, mask [b, n_K] (1 = keep), filled with finfo.min."""

    def __init__(self, bug: str | None = None):
        super().__init__()
        self.bug, self.heads, self.d = bug, 4, 8
        self.q_lin = nn.Linear(32, 32)
        self.k_lin = nn.Linear(32, 32)
        self.v_lin = nn.Linear(32, 32)
        self.out_lin = nn.Linear(32, 32)
        _moved(self, 14)

    def forward(self, query, key, value, mask):
        bs, q_len, _ = query.shape
        k_len = key.size(1)

        def shape(x):
            return x.view(bs, -1, self.heads, self.d).transpose(1, 2)

        key, value = _fed(self.bug, key, value)
        q = shape(self.q_lin(query)) / math.sqrt(self.d)
        k = shape(self.k_lin(key))
        v = shape(self.k_lin(value)) if self.bug == "values_from_keys" else shape(self.v_lin(value))
        scores = torch.matmul(q, k.transpose(2, 3))
        masked = (mask == 0).view(bs, 1, 1, k_len).expand_as(scores)
        weights = scores.masked_fill(masked, torch.finfo(scores.dtype).min).softmax(dim=-1)
        context = torch.matmul(weights, v).transpose(1, 2).reshape(bs, q_len, -1)
        return self.out_lin(context)


class BartLikeCross(nn.Module):
    """BART-like cross-attention with its keys and values from inputs of their own: the queries scaled after their
    projection, heads folded into the batch for bmm."""

    def __init__(self, bug: str | None = None):
        super().__init__()
        self.bug, self.num_heads, self.head_dim = bug, 4, 8
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(32, 32)
        self.k_proj = nn.Linear(32, 32)
        self.v_proj = nn.Linear(32, 32)
        self.out_proj = nn.Linear(32, 32)
        _moved(self, 15)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_states, value_states):
        bsz, tgt_len, _ = hidden_states.size()
        src_len = key_states.size(1)
        query = self._shape(self.q_proj(hidden_states) * self.scaling, tgt_len, bsz)
        key_states, value_states = _fed(self.bug, key_states, value_states)
        keys = self._shape(self.k_proj(key_states), src_len, bsz)
        values = self._shape((self.k_proj if self.bug == "values_from_keys" else self.v_proj)(value_states),
                             src_len, bsz)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query, keys, values = query.view(*proj_shape), keys.view(*proj_shape), values.view(*proj_shape)
        weights = F.softmax(torch.bmm(query, keys.transpose(1, 2)), dim=-1)
        out = torch.bmm(weights, values).view(bsz, self.num_heads, tgt_len, self.head_dim)
        return self.out_proj(out.transpose(1, 2).reshape(bsz, tgt_len, -1))


class LinearQKV(nn.Module):
    """Three nn.Linear layers on `forward(q, k, v)`, F.scaled_dot_product_attention, no output projection's bias."""

    def __init__(self, bug: str | None = None):
        super().__init__()
        self.bug, self.h = bug, 4
        self.to_q = nn.Linear(32, 32, bias=False)
        self.to_k = nn.Linear(32, 32, bias=False)
        self.to_v = nn.Linear(32, 32, bias=False)
        self.to_out = nn.Linear(32, 32)
        _moved(self, 16)

    def forward(self, q, k, v, attn_mask: torch.Tensor | None = None):
        k, v = _fed(self.bug, k, v)
        q, k = self.to_q(q), self.to_k(k)
        v = self.to_k(v) if self.bug == "values_from_keys" else self.to_v(v)
        q, k, v = (t.unflatten(-1, (self.h, -1)).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.to_out(out.transpose(1, 2).flatten(2))
