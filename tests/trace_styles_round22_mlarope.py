"""Styles of our own of multi-head latent attention whose RoPE turns only the rotary part of each head, for
tests/test_trace_round22_mlarope.py (round 20's DeepSeek-V2: RoPE left out of the rotary part, or a decode step's
positions not offset, were 'none of the usual causes fits'). Weights moved off their initial values.

- CachedV2: transformers 4's DeepSeek-V2 eager form, a query latent (q_a_proj, its RMSNorm, q_b_proj), the rotary
  parts turned as complex numbers in place (interleaved pairs), keys and values kept expanded in a transformers
  Cache (`past_key_value.update(...)`, positions from `get_seq_length()`). `bug`: 'no_rope' (the rotary parts never
  turned), 'no_offset' (a decode step's positions from 0).
- InferenceCache: DeepSeek's inference form (wq_a, wkv_a, ...; `start_pos`; `freqs_cis[start_pos:end_pos]`),
  keys and values in the module's own k_cache / v_cache buffers, einsum scores. `bug`: 'no_rope', 'no_offset'.
- HalfSplitMLA: a MiniCPM3-like module (one q_proj, no query latent) whose forward hands its tensors to a plain
  function, the rotary parts turned half-split with cos/sin tables, the cache a (keys, values) pair it returns.
  `bug`: 'no_rope', 'no_offset', 'base' (RoPE base 500000 where its config says 10000).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def trained(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def lower_right(n_q: int, n_k: int) -> torch.Tensor:
    """An additive causal mask [n_q, n_k] for the last n_q of n_k positions."""
    return torch.full((n_q, n_k), float("-inf")).triu(n_k - n_q + 1)


# --- transformers 4's DeepSeek-V2 ---------------------------------------------------------------------------------

class CachedV2(nn.Module):
    def __init__(self, hidden_size: int = 32, num_heads: int = 4, q_lora_rank: int = 12, kv_lora_rank: int = 10,
                 qk_nope_head_dim: int = 6, qk_rope_head_dim: int = 4, v_head_dim: int = 5, rope_theta: float = 10000.0,
                 layer_idx: int = 0, bug: str = "") -> None:
        super().__init__()
        self.num_heads, self.layer_idx, self.bug = num_heads, layer_idx, bug
        self.nope, self.rope, self.v_dim, self.rank = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
        self.q_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(q_lora_rank)
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)
        self.softmax_scale = self.q_head_dim ** -0.5
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, qk_rope_head_dim, 2).float() / qk_rope_head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        trained(self, 20)

    def _freqs_cis(self, position_ids: torch.Tensor) -> torch.Tensor:
        freqs = position_ids[..., None].float() * self.inv_freq  # [1, q_len, rope / 2]
        return torch.polar(torch.ones_like(freqs), freqs)

    def _rotate(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:  # [b, h, s, rope], interleaved
        z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(z * freqs_cis[:, None]).flatten(3).type_as(x)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_value=None) -> torch.Tensor:
        bsz, q_len, _ = hidden_states.size()
        past = past_key_value.get_seq_length(self.layer_idx) if past_key_value is not None else 0
        start = 0 if self.bug == "no_offset" else past
        position_ids = torch.arange(start, start + q_len)[None]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(bsz, q_len, self.num_heads, self.q_head_dim).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope], dim=-1)
        compressed_kv, k_pe = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.rank, self.rope], dim=-1)
        k_pe = k_pe.view(bsz, q_len, 1, self.rope).transpose(1, 2)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed_kv))
        kv = kv.view(bsz, q_len, self.num_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, value_states = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        if self.bug != "no_rope":
            freqs_cis = self._freqs_cis(position_ids)
            q_pe, k_pe = self._rotate(q_pe, freqs_cis), self._rotate(k_pe, freqs_cis)
        query_states = torch.cat([q_nope, q_pe], dim=-1)
        key_states = torch.cat([k_nope, k_pe.expand(-1, self.num_heads, -1, -1)], dim=-1)
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.softmax_scale
        if attention_mask is None:
            attention_mask = lower_right(q_len, key_states.shape[-2])
        attn_weights = F.softmax(attn_weights + attention_mask, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


# --- DeepSeek's inference/model.py ---------------------------------------------------------------------------------

def precompute_freqs_cis(dim: int, seqlen: int, base: float) -> torch.Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return torch.polar(torch.ones(seqlen, dim // 2), torch.outer(torch.arange(seqlen).float(), freqs))


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, x.size(1), 1, x.size(-1))
    return torch.view_as_real(x * freqs_cis).flatten(3).to(dtype)


class InferenceCache(nn.Module):
    def __init__(self, dim: int = 32, n_heads: int = 4, q_lora_rank: int = 10, kv_lora_rank: int = 12,
                 qk_nope_head_dim: int = 8, qk_rope_head_dim: int = 4, v_head_dim: int = 6, max_batch_size: int = 8,
                 max_seq_len: int = 32, bug: str = "") -> None:
        super().__init__()
        self.n_heads, self.kv_lora_rank, self.bug = n_heads, kv_lora_rank, bug
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
        self.q_norm = RMSNorm(q_lora_rank)
        self.wq_b = nn.Linear(q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        self.softmax_scale = self.qk_head_dim ** -0.5
        self.register_buffer("freqs_cis", precompute_freqs_cis(qk_rope_head_dim, max_seq_len, 10000.0),
                             persistent=False)
        self.register_buffer("k_cache", torch.zeros(max_batch_size, max_seq_len, n_heads, self.qk_head_dim),
                             persistent=False)
        self.register_buffer("v_cache", torch.zeros(max_batch_size, max_seq_len, n_heads, v_head_dim),
                             persistent=False)
        trained(self, 31)

    def forward(self, x: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        bsz, seqlen, _ = x.size()
        end_pos = start_pos + seqlen
        freqs_cis = self.freqs_cis[0:seqlen] if self.bug == "no_offset" else self.freqs_cis[start_pos:end_pos]
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(bsz, seqlen, self.n_heads, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.unsqueeze(2)
        if self.bug != "no_rope":
            q_pe, k_pe = apply_rotary_emb(q_pe, freqs_cis), apply_rotary_emb(k_pe, freqs_cis)
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, self.n_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)
        self.k_cache[:bsz, start_pos:end_pos] = k
        self.v_cache[:bsz, start_pos:end_pos] = v
        scores = torch.einsum("bshd,bthd->bsht", q, self.k_cache[:bsz, :end_pos]) * self.softmax_scale
        scores = scores + lower_right(seqlen, end_pos).unsqueeze(1)
        scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
        out = torch.einsum("bsht,bthd->bshd", scores, self.v_cache[:bsz, :end_pos])
        return self.wo(out.flatten(2))


# --- a MiniCPM3-like module, its attention a plain function ---------------------------------------------------------

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(positions: torch.Tensor, dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
    emb = torch.outer(positions.float(), inv_freq)
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos(), emb.sin()


def latent_attention(q: torch.Tensor, compressed: torch.Tensor, kv_norm: nn.Module, kv_up: nn.Linear,
                     cos: torch.Tensor | None, sin: torch.Tensor | None, n_heads: int, d_nope: int, d_rope: int,
                     d_v: int, past: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple]:
    """q [b, n, h·(d_nope + d_rope)], compressed [b, n, d_latent + d_rope]: the heads' output [b, n, h·d_v] and the
    keys and values to keep."""
    b, n, _ = q.shape
    q = q.view(b, n, n_heads, d_nope + d_rope).transpose(1, 2)
    q_nope, q_pe = q.split([d_nope, d_rope], dim=-1)
    latent, k_pe = compressed.split([compressed.shape[-1] - d_rope, d_rope], dim=-1)
    k_pe = k_pe[:, None]  # [b, 1, n, d_rope]
    if cos is not None and sin is not None:
        q_pe = q_pe * cos + rotate_half(q_pe) * sin
        k_pe = k_pe * cos + rotate_half(k_pe) * sin
    kv = kv_up(kv_norm(latent)).view(b, n, n_heads, d_nope + d_v).transpose(1, 2)
    k_nope, v = kv.split([d_nope, d_v], dim=-1)
    k = torch.cat([k_nope, k_pe.expand(-1, n_heads, -1, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d_nope + d_rope) + lower_right(n, k.shape[2])
    out = torch.matmul(w.softmax(-1), v)
    return out.transpose(1, 2).reshape(b, n, -1), (k, v)


class HalfSplitMLA(nn.Module):
    def __init__(self, hidden_size: int = 24, num_heads: int = 3, kv_lora_rank: int = 8, qk_nope_head_dim: int = 6,
                 qk_rope_head_dim: int = 4, v_head_dim: int = 6, rope_theta: float = 10000.0, bug: str = "") -> None:
        super().__init__()
        self.num_heads, self.bug, self.rope_theta = num_heads, bug, rope_theta
        self.dims = (qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
        self.q_proj = nn.Linear(hidden_size, num_heads * (qk_nope_head_dim + qk_rope_head_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)
        trained(self, 9)

    def forward(self, hidden_states: torch.Tensor, past_key_value: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        n = hidden_states.shape[1]
        past = 0 if past_key_value is None or self.bug == "no_offset" else past_key_value[0].shape[2]
        base = 500000.0 if self.bug == "base" else self.rope_theta
        cos, sin = rope_tables(torch.arange(past, past + n), self.dims[1], base)
        if self.bug == "no_rope":
            cos = sin = None
        out, _ = latent_attention(self.q_proj(hidden_states), self.kv_a_proj_with_mqa(hidden_states),
                                  self.kv_a_layernorm, self.kv_b_proj, cos, sin, self.num_heads, *self.dims,
                                  past_key_value)
        return self.o_proj(out)
