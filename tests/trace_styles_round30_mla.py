"""Styles of our own of multi-head latent attention (DeepSeek-V2/V3's MLA), for tests/test_trace_round30_mla.py (issue
#41: transformers 5's own DeepseekV3Attention traced in place read its width as q_lora_rank, was handed RoPE's
tables as wide as a head rather than its rotary part, and its rope_interleave called a mistake). Weights moved off
their initial values.

- V3Gathered: transformers 5's DeepSeek-V3 form: a query latent (q_a_proj, its RMSNorm, q_b_proj), the model's
  (cos, sin) handed in as `position_embeddings`, d_rope wide, the rotary parts' even and odd coordinates turned
  where they lie with the tables' first half (`apply_rotary_pos_emb_interleave`), its scale d_K^-0.5 · mscale² from
  its config's yarn rope_parameters (mscale_all_dim, factor). `bug`: 'nope_scale' (the scale over
  qk_nope_head_dim alone), 'k_pe_unturned' (the shared key part never turned).
- LiteDirect: a DeepSeek-V2-Lite-like module, no query latent (one q_proj), Meta's `freqs_cis` handed in, the
  rotary parts turned as complex numbers in place (interleaved pairs), einsum scores [b, s, h, t] / √d_K, its own
  causal mask over them (DeepSeek's inference code's `scores + mask.unsqueeze(1)`). `bug`: 'nope_scale',
  'k_pe_from_query' (each head's key rotary part taken from its query's, not the shared one the latent Linear
  makes).
- EinsumMLA: a functional form: the module's Linear layers (wq, wkv_a, wkv_b, wo) handed to a plain function
  that builds its own half-split tables (MiniCPM3's form) and takes its scores with einsum. `bug`: 'rope_on_nope'
  (the first d_rope coordinates of each head turned, inside the no-RoPE part, the rotary part left as it is),
  'nope_scale'.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def trained(module: nn.Module, seed: int) -> None:
    """Weights drawn from `seed` alone (two instances alike), norms' gains off 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.3 * noise if p.dim() == 1 else noise / math.sqrt(p.shape[-1]))


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


# --- transformers 5's DeepSeek-V3 -----------------------------------------------------------------------------------

class MLAConfig:
    """A config as transformers 5 keeps one: sizes, and a yarn RoPE's rope_parameters."""

    def __init__(self, hidden_size: int = 32, num_attention_heads: int = 4, q_lora_rank: int = 12,
                 kv_lora_rank: int = 10, qk_nope_head_dim: int = 6, qk_rope_head_dim: int = 4,
                 v_head_dim: int = 5) -> None:
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                                "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0


def apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    k_embed = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    return q_embed, k_embed


class V3Gathered(nn.Module):
    def __init__(self, config: MLAConfig | None = None, bug: str = "") -> None:
        super().__init__()
        self.config = config = config or MLAConfig()
        self.bug = bug
        self.num_heads = config.num_attention_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.kv_lora_rank, self.v_head_dim = config.kv_lora_rank, config.v_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, config.hidden_size, bias=False)
        width = self.qk_nope_head_dim if bug == "nope_scale" else self.qk_head_dim
        rope = config.rope_parameters
        self.scaling = width ** -0.5 * yarn_get_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
        trained(self, 30)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq_len = hidden_states.shape[:-1]
        q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q_states = q_states.view(bsz, seq_len, -1, self.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        k_pass, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pass = self.kv_b_proj(self.kv_a_layernorm(k_pass))
        k_pass = k_pass.view(bsz, seq_len, -1, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
        k_pass, value_states = torch.split(k_pass, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_rot = k_rot.view(bsz, 1, seq_len, self.qk_rope_head_dim)
        cos, sin = position_embeddings
        q_turned, k_turned = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        if self.bug != "k_pe_unturned":
            k_rot = k_turned
        k_rot = k_rot.expand(*k_pass.shape[:-1], -1)
        query_states = torch.cat((q_pass, q_turned), dim=-1)
        key_states = torch.cat((k_pass, k_rot), dim=-1)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(bsz, seq_len, -1)
        return self.o_proj(attn_output)


# --- DeepSeek-V2-Lite-like: no query latent, Meta's freqs_cis ----------------------------------------------------

def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x [b, s, h, d] turned as complex numbers, pairs (2i, 2i + 1); freqs_cis [s, d / 2]."""
    shape = x.shape
    z = torch.view_as_complex(x.float().reshape(*shape[:-1], -1, 2))
    z = z * freqs_cis.view(1, z.size(1), 1, z.size(-1))
    return torch.view_as_real(z).flatten(3).to(x.dtype)


class LiteDirect(nn.Module):
    def __init__(self, dim: int = 24, n_heads: int = 3, kv_lora_rank: int = 8, qk_nope_head_dim: int = 6,
                 qk_rope_head_dim: int = 4, v_head_dim: int = 6, bug: str = "") -> None:
        super().__init__()
        self.n_heads, self.bug = n_heads, bug
        self.nope, self.rope_dim, self.rank, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim
        self.head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        self.softmax_scale = (qk_nope_head_dim if bug == "nope_scale" else self.head_dim) ** -0.5
        trained(self, 31)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)  # DeepSeek's [s, t], over the heads' axis
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        q_pe = apply_rotary_emb(q_pe, freqs_cis)
        kv = self.wkv_a(x)
        kv, k_pe = kv.split([self.rank, self.rope_dim], dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis)
        if self.bug == "k_pe_from_query":
            k_pe = q_pe
        kv = self.wkv_b(self.kv_norm(kv)).view(b, s, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)
        scores = torch.einsum("bshd,bthd->bsht", q, k) * self.softmax_scale
        scores = scores + mask.unsqueeze(1)
        scores = scores.softmax(dim=-1)
        out = torch.einsum("bsht,bthd->bshd", scores, v)
        return self.wo(out.flatten(2))


# --- a functional form, its own half-split tables ----------------------------------------------------------------

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def latent_attention(x, wq, wkv_a, kv_norm, wkv_b, wo, n_head, d_nope, d_rope, d_v, base=10000.0, bug=""):
    """MLA as one function: queries, the latent and the shared rotary key part, half-split RoPE over positions 0..n-1,
    causal einsum scores."""
    b, n, _ = x.shape
    q = wq(x).view(b, n, n_head, d_nope + d_rope).permute(0, 2, 1, 3)
    latent, k_pe = wkv_a(x).split([wkv_a.out_features - d_rope, d_rope], dim=-1)
    kv = wkv_b(kv_norm(latent)).view(b, n, n_head, d_nope + d_v).permute(0, 2, 1, 3)
    k_nope, v = kv[..., :d_nope], kv[..., d_nope:]
    inv_freq = 1.0 / base ** (torch.arange(0, d_rope, 2, dtype=torch.float32) / d_rope)
    angles = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, n_head, -1, -1)], dim=-1)
    q = torch.cat([q[..., :d_nope], q[..., d_nope:]], dim=-1)
    at = slice(0, d_rope) if bug == "rope_on_nope" else slice(d_nope, d_nope + d_rope)
    q_r, k_r = q[..., at], k[..., at]
    q_r, k_r = q_r * cos + rotate_half(q_r) * sin, k_r * cos + rotate_half(k_r) * sin
    q = torch.cat([q[..., :at.start], q_r, q[..., at.stop:]], dim=-1)
    k = torch.cat([k[..., :at.start], k_r, k[..., at.stop:]], dim=-1)
    scale = (d_nope if bug == "nope_scale" else d_nope + d_rope) ** -0.5
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)
    return wo(out.transpose(1, 2).reshape(b, n, n_head * d_v))


class EinsumMLA(nn.Module):
    def __init__(self, d_model: int = 24, n_head: int = 4, kv_rank: int = 8, d_nope: int = 6, d_rope: int = 4,
                 d_v: int = 4, bug: str = "") -> None:
        super().__init__()
        self.n_head, self.d_nope, self.d_rope, self.d_v, self.bug = n_head, d_nope, d_rope, d_v, bug
        self.wq = nn.Linear(d_model, n_head * (d_nope + d_rope), bias=False)
        self.wkv_a = nn.Linear(d_model, kv_rank + d_rope, bias=False)
        self.kv_norm = nn.RMSNorm(kv_rank, eps=1e-6)
        self.wkv_b = nn.Linear(kv_rank, n_head * (d_nope + d_v), bias=False)
        self.wo = nn.Linear(n_head * d_v, d_model, bias=False)
        trained(self, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return latent_attention(x, self.wq, self.wkv_a, self.kv_norm, self.wkv_b, self.wo, self.n_head, self.d_nope,
                                self.d_rope, self.d_v, bug=self.bug)
