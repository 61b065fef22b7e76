"""Styles of our own of multi-head latent attention as transformers 5's MLA classes beyond DeepSeek write it, for
tests/test_trace_round31_mlaplace.py (issue #41: Mistral4Attention, KimiLinearAttention and LongcatFlashMLA traced
in place failed, and DeepSeek's inference code's [s, t] mask argument was handed key padding). Weights moved off
their initial values (_trace_ref.trained).

- GainedMLA: LongCat-Flash's form: a query latent, the query's parts times √(d_feat / q_lora_rank) and the normed
  latent times √(d_feat / kv_lora_rank) (`mla_scale_q_lora`, `mla_scale_kv_lora`), its own half-split tables.
- NopeMLA: Kimi Linear's MLA layers: one q_proj, the shared key part never turned (NoPE), its own causal mask.
- TunedMLA: Mistral 4's: the joined query times `1 + β · log(1 + floor(p / original_max_position_embeddings))` at its
  position p (`get_llama_4_attn_scale`, the numbers in the rope_parameters it keeps), its own half-split tables.
- MaskArg: DeepSeek's inference code: Meta's freqs_cis handed in, pairs turned as complex numbers, einsum scores
  [b, s, h, t], and the [s, t] mask its model hands every layer added as `scores + mask.unsqueeze(1)`.

`bug='nope_scale'` in each: the scores scaled by qk_nope_head_dim^-0.5 where d_K = d_nope + d_rope belongs.
"""

from __future__ import annotations

import torch
from _trace_ref import trained
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def half_split(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """x [.., s, d] turned half-split at positions 0 .. s − 1, its own tables."""
    s, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, device=x.device).float() / d)
    freqs = torch.outer(torch.arange(s, device=x.device).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1).to(x.dtype)
    return x * emb.cos() + rotate_half(x) * emb.sin()


class _Latent(nn.Module):
    """The layers every style holds: an optional query latent, the latent with its rotary key part, the expansion."""

    def __init__(self, dim: int, heads: int, q_lora_rank: int | None, kv_lora_rank: int, nope: int, rope: int,
                 v_dim: int, bug: str, seed: int) -> None:
        super().__init__()
        self.heads, self.nope, self.rope, self.rank, self.v_dim, self.bug = heads, nope, rope, kv_lora_rank, v_dim, bug
        self.qk_head_dim = nope + rope
        if q_lora_rank is None:
            self.q_proj = nn.Linear(dim, heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank)
            self.q_b_proj = nn.Linear(q_lora_rank, heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, kv_lora_rank + rope, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank)
        self.kv_b_proj = nn.Linear(kv_lora_rank, heads * (nope + v_dim), bias=False)
        self.o_proj = nn.Linear(heads * v_dim, dim, bias=False)
        self.scaling = (nope if bug == "nope_scale" else self.qk_head_dim) ** -0.5
        trained(self, seed)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(b, s, -1, self.qk_head_dim).transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, _, s, _ = q.shape
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        causal = torch.full((s, s), float("-inf"), device=q.device).triu(1)
        weights = torch.softmax(scores + causal, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)

    def expand(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = latent.shape
        kv = self.kv_b_proj(latent).view(b, s, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        return k, v


class GainedMLA(_Latent):
    def __init__(self, bug: str = "") -> None:
        super().__init__(32, 4, 16, 8, 6, 4, 6, bug, 41)
        self.mla_scale_q_lora = (32 / 16) ** 0.5
        self.mla_scale_kv_lora = (32 / 8) ** 0.5

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, _ = hidden_states.shape
        q_pass, q_rot = torch.split(self.queries(hidden_states), [self.nope, self.rope], dim=-1)
        kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.rank, self.rope], dim=-1)
        k_pass = self.kv_a_layernorm(kv_pass)
        q_pass = q_pass * self.mla_scale_q_lora
        q_rot = q_rot * self.mla_scale_q_lora
        k_pass = k_pass * self.mla_scale_kv_lora
        q_rot, k_rot = half_split(q_rot), half_split(k_rot.view(b, 1, s, self.rope))
        k, v = self.expand(k_pass, k_rot)
        return self.attend(torch.cat((q_pass, q_rot), dim=-1), k, v)


class GainedInPlaceMLA(GainedMLA):
    """LongCat-Flash's gains multiplied in place: the whole query before its split, the normed latent."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, _ = hidden_states.shape
        q = self.queries(hidden_states)
        q *= self.mla_scale_q_lora
        q_pass, q_rot = torch.split(q, [self.nope, self.rope], dim=-1)
        kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.rank, self.rope], dim=-1)
        k_pass = self.kv_a_layernorm(kv_pass)
        k_pass *= self.mla_scale_kv_lora
        q_rot, k_rot = half_split(q_rot), half_split(k_rot.view(b, 1, s, self.rope))
        k, v = self.expand(k_pass, k_rot)
        return self.attend(torch.cat((q_pass, q_rot), dim=-1), k, v)


class NopeMLA(_Latent):
    def __init__(self, bug: str = "") -> None:
        super().__init__(24, 3, None, 8, 6, 4, 6, bug, 42)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, _ = hidden_states.shape
        q = self.queries(hidden_states)
        kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.rank, self.rope], dim=-1)
        k, v = self.expand(self.kv_a_layernorm(kv_nope), k_rot.view(b, 1, s, self.rope))
        return self.attend(q, k, v)


class TunedMLA(_Latent):
    def __init__(self, bug: str = "") -> None:
        super().__init__(32, 4, 16, 8, 6, 4, 6, bug, 43)
        self.rope_parameters = {"rope_theta": 10000.0, "original_max_position_embeddings": 2,
                                "llama_4_scaling_beta": 0.3}

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, _ = hidden_states.shape
        q_pass, q_rot = torch.split(self.queries(hidden_states), [self.nope, self.rope], dim=-1)
        kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.rank, self.rope], dim=-1)
        q_rot, k_rot = half_split(q_rot), half_split(k_rot.view(b, 1, s, self.rope))
        query = torch.cat((q_pass, q_rot), dim=-1)
        positions = torch.arange(s, device=hidden_states.device)
        held = self.rope_parameters
        beta, step = held["llama_4_scaling_beta"], held["original_max_position_embeddings"]
        tuned = 1 + beta * torch.log(1 + torch.floor(positions / step))
        query = query * tuned[None, None, :, None].to(query.dtype)
        k, v = self.expand(self.kv_a_layernorm(kv_pass), k_rot)
        return self.attend(query, k, v)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x [b, s, h, d] turned as complex numbers, pairs (2i, 2i + 1); freqs_cis [s, d / 2]."""
    shape = x.shape
    z = torch.view_as_complex(x.float().reshape(*shape[:-1], -1, 2))
    z = z * freqs_cis.view(1, z.size(1), 1, z.size(-1))
    return torch.view_as_real(z).flatten(3).to(x.dtype)


class MaskArg(nn.Module):
    def __init__(self, dim: int = 24, n_heads: int = 3, kv_lora_rank: int = 8, qk_nope_head_dim: int = 6,
                 qk_rope_head_dim: int = 4, v_head_dim: int = 6, bug: str = "") -> None:
        super().__init__()
        self.n_heads, self.nope, self.rope_dim = n_heads, qk_nope_head_dim, qk_rope_head_dim
        self.rank, self.v_dim, self.head_dim = kv_lora_rank, v_head_dim, qk_nope_head_dim + qk_rope_head_dim
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        self.softmax_scale = (qk_nope_head_dim if bug == "nope_scale" else self.head_dim) ** -0.5
        trained(self, 44)

    def forward(self, x: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        q_pe = apply_rotary_emb(q_pe, freqs_cis)
        kv, k_pe = self.wkv_a(x).split([self.rank, self.rope_dim], dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis)
        kv = self.wkv_b(self.kv_norm(kv)).view(b, s, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)
        scores = torch.einsum("bshd,bthd->bsht", q, k) * self.softmax_scale
        if mask is not None:
            scores = scores + mask.unsqueeze(1)
        scores = scores.softmax(dim=-1)
        return self.wo(torch.einsum("bsht,bthd->bshd", scores, v).flatten(2))

