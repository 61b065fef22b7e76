"""Partial RoPE in three code styles of our own, each reading the share of each head it rotates from its config, and
plants that rotate another share while the config still says its own (tests/test_trace_round29_ropefraction.py).

- FusedPerHead: Persimmon's and StableLM's way: one query_key_value laid per head [.., h, 3, d], a LayerNorm on each
  head's q and k, `self.rotary_ndims = int(head_dim * config.rope_parameters["partial_rotary_factor"])` (a
  transformers 5 PersimmonConfig), tables made in the forward over the rotated width, rotate_half.
- NeoXStyle: GPT-NeoX's: a config of its own with `rotary_pct`, a rotary submodule keeping `inv_freq` over
  `rotary_ndims`, the fused projection laid per head, a causal mask of its own.
- PhiStyle: Phi's: separate q_proj, k_proj, v_proj and dense, `partial_rotary_factor` and `rope_theta` in a config of
  its own, the rotated width kept as `rotary_emb_dim` (flash-attn's name), the tables handed to the forward.
- FixedHalf: a module with no config, rotating half of each head as its own code says (`self.rotary_dim = d_head //
  2`, ChatGLM's habit): the share is the module's convention.

Plants (`bug=`): 'whole_head' rotates every coordinate and says so in its attribute (rotary_ndims = head_dim) while
the config keeps its fraction; 'narrow' rotates a share of another size (a quarter of the head where the config says
a half, or the other way round); NeoXStyle's 'fixed_quarter' rotates a quarter while its config says rotary_pct = 1;
PhiStyle's 'theta_attr' rotates with a base of its own attribute (rope_theta = 10000) while its config says 500000.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PersimmonConfig  # noqa: F401  (--init builds it)


def perturb(module: nn.Module, seed: int) -> None:
    """Every parameter moved off its init, as a trained model's are."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def tables(n: int, dim: int, base: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, dim] for positions 0 .. n - 1, half-split (cat((freqs, freqs)))."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class NeoXArgs:
    """A config of its own, as a checkpoint's config.json says it."""

    def __init__(self, hidden_size: int = 64, num_attention_heads: int = 4, rotary_pct: float = 0.25,
                 rotary_emb_base: float = 10000.0):
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads
        self.rotary_pct, self.rotary_emb_base = rotary_pct, rotary_emb_base


class PhiArgs:
    def __init__(self, hidden_size: int = 64, num_attention_heads: int = 4, partial_rotary_factor: float = 0.5,
                 rope_theta: float = 10000.0):
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads
        self.partial_rotary_factor, self.rope_theta = partial_rotary_factor, rope_theta


class FusedPerHead(nn.Module):
    def __init__(self, config, bug: str | None = None):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.rotary_ndims = int(self.head_dim * config.rope_parameters["partial_rotary_factor"])
        if bug == "whole_head":
            self.rotary_ndims = self.head_dim
        elif bug == "narrow":
            self.rotary_ndims = self.rotary_ndims // 2
        self.base = config.rope_parameters["rope_theta"]
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.q_layernorm = nn.LayerNorm(self.head_dim)
        self.k_layernorm = nn.LayerNorm(self.head_dim)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        perturb(self, 3)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, t, _ = hidden_states.shape
        fused = self.query_key_value(hidden_states).view(b, t, self.num_heads, 3, self.head_dim)
        q, k, v = fused[..., 0, :], fused[..., 1, :], fused[..., 2, :]
        q, k = self.q_layernorm(q).transpose(1, 2), self.k_layernorm(k).transpose(1, 2)
        v = v.transpose(1, 2)
        cos, sin = tables(t, self.rotary_ndims, self.base, q.dtype)
        q_rot, q_pass = q[..., : self.rotary_ndims], q[..., self.rotary_ndims:]
        k_rot, k_pass = k[..., : self.rotary_ndims], k[..., self.rotary_ndims:]
        q = torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), dim=-1)
        k = torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k_pass), dim=-1)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        out = torch.matmul(scores.softmax(dim=-1), v)
        return self.dense(out.transpose(1, 2).reshape(b, t, -1))


class NeoXRotary(nn.Module):
    def __init__(self, dim: int, base: float):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.arange(n, device=x.device, dtype=self.inv_freq.dtype)[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class NeoXStyle(nn.Module):
    def __init__(self, config: NeoXArgs, bug: str | None = None):
        super().__init__()
        self.config = config
        self.num_attention_heads = config.num_attention_heads
        self.head_size = config.hidden_size // config.num_attention_heads
        self.rotary_ndims = int(self.head_size * config.rotary_pct)
        if bug == "whole_head":
            self.rotary_ndims = self.head_size
        elif bug == "narrow":
            self.rotary_ndims = self.rotary_ndims * 2
        elif bug == "fixed_quarter":
            self.rotary_ndims = self.head_size // 4
        self.rotary_emb = NeoXRotary(self.rotary_ndims, config.rotary_emb_base)
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        perturb(self, 5)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, t, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(b, t, self.num_attention_heads, 3 * self.head_size)
        qkv = qkv.permute(0, 2, 1, 3)
        query, key, value = qkv.split(self.head_size, dim=-1)
        cos, sin = self.rotary_emb(value, t)
        r = self.rotary_ndims
        query = torch.cat((query[..., :r] * cos + rotate_half(query[..., :r]) * sin, query[..., r:]), dim=-1)
        key = torch.cat((key[..., :r] * cos + rotate_half(key[..., :r]) * sin, key[..., r:]), dim=-1)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.dense(out.permute(0, 2, 1, 3).reshape(b, t, -1))


class PhiStyle(nn.Module):
    def __init__(self, config: PhiArgs, bug: str | None = None):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.rotary_emb_dim = int(self.head_dim * config.partial_rotary_factor)
        if bug == "whole_head":
            self.rotary_emb_dim = self.head_dim
        elif bug == "narrow":
            self.rotary_emb_dim = self.rotary_emb_dim // 2
        self.rope_theta = 10000.0 if bug == "theta_attr" else config.rope_theta
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        perturb(self, 7)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = tables(t, self.rotary_emb_dim, self.rope_theta, q.dtype)
        r = self.rotary_emb_dim
        q = torch.cat((q[..., :r] * cos + rotate_half(q[..., :r]) * sin, q[..., r:]), dim=-1)
        k = torch.cat((k[..., :r] * cos + rotate_half(k[..., :r]) * sin, k[..., r:]), dim=-1)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            scores = scores + attention_mask
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.dense(out.transpose(1, 2).reshape(b, t, -1))


class FixedHalf(nn.Module):
    """No config: half of each head turns, as this code says."""

    def __init__(self, dim: int = 64, n_heads: int = 4):
        super().__init__()
        self.n_heads, self.d_head = n_heads, dim // n_heads
        self.rotary_dim = self.d_head // 2
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        perturb(self, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4)
        cos, sin = tables(t, self.rotary_dim, 10000.0, q.dtype)
        r = self.rotary_dim
        q = torch.cat((q[..., :r] * cos + rotate_half(q[..., :r]) * sin, q[..., r:]), dim=-1)
        k = torch.cat((k[..., :r] * cos + rotate_half(k[..., :r]) * sin, k[..., r:]), dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, -1))


class CapArgs:
    def __init__(self, hidden_size: int = 64, num_attention_heads: int = 4, attn_logit_softcapping: float = 3.0):
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads
        self.attn_logit_softcapping = attn_logit_softcapping


class CappedCopy(nn.Module):
    """Gemma 2's habit: the config's softcap copied onto the module (`self.attn_logit_softcapping = config....`), and
    the copy used; 'cap_attr' copies another number (5) while the config says 3."""

    def __init__(self, config: CapArgs, bug: str | None = None):
        super().__init__()
        self.config = config
        self.num_heads, self.head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
        self.attn_logit_softcapping = 5.0 if bug == "cap_attr" else config.attn_logit_softcapping
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)
        perturb(self, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.head_dim ** -0.5
        cap = self.attn_logit_softcapping
        scores = torch.tanh(scores / cap) * cap
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.matmul(scores.softmax(-1), v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
