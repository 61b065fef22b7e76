"""Styles of our own whose RoPE turns at a base no list holds (tests/test_trace_round24_ropebase.py), each in the
idiom of a real library, `bug` planting the base a real mistake gives:

- HFLlama(config): transformers' LlamaAttention with its own LlamaRotaryEmbedding (an `inv_freq` buffer,
  `1 / base ** (arange(0, d, 2) / d)`), rotate_half, grouped heads, `config.rope_theta` 25000. Plants: 'ntk' (the
  dynamic-NTK base `theta · (factor)^(d / (d − 2))` used though the config asks for no scaling), 'scaled_twice'
  (`rope_theta * factor` for a rope_scaling factor the config holds for another purpose).
- MetaLlama(args): Meta's llama/model.py: `precompute_freqs_cis(dim, end, theta)` as complex polars,
  `apply_rotary_emb` by `view_as_complex` (interleaved pairs), `args.rope_theta` 123456. Plant: 'arg_order'
  (`precompute_freqs_cis(head_dim, theta, end)`: the table's length taken as theta, 96).
- GPTJ(config): GPT-J's `fixed_pos_embedding` and `rotate_every_two` (interleaved pairs via repeat_interleave
  tables) over the whole head, `config.rotary_base` 70000. Plant: 'field' (the base read from
  `config.max_position_embeddings`, 2048).
- ntk_attention(q, k, v): a function whose base no name says, computed from its own constants, `10000 · 3^(d/(d−2))`.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module: nn.Module, seed: int) -> None:
    """Weights moved off their initial values, biases not zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def llama_config(**kw) -> SimpleNamespace:
    said = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, rope_theta=25000.0,
                max_position_embeddings=64, scaling_factor=2.0)
    said.update(kw)
    return SimpleNamespace(**said)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class HFLlama(nn.Module):
    def __init__(self, config: SimpleNamespace | None = None, bug: str | None = None):
        super().__init__()
        self.config = config = config or llama_config()
        self.h, self.kvh = config.num_attention_heads, config.num_key_value_heads
        self.d = config.hidden_size // self.h
        self.q_proj = nn.Linear(config.hidden_size, self.h * self.d)
        self.k_proj = nn.Linear(config.hidden_size, self.kvh * self.d)
        self.v_proj = nn.Linear(config.hidden_size, self.kvh * self.d)
        self.o_proj = nn.Linear(self.h * self.d, config.hidden_size, bias=False)
        base = config.rope_theta
        if bug == "ntk":
            base = base * config.scaling_factor ** (self.d / (self.d - 2))
        elif bug == "scaled_twice":
            base = base * config.scaling_factor
        self.rotary_emb = LlamaRotaryEmbedding(self.d, base)
        _trained(self, 3)

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = hidden_states.shape
        if position_ids is None:
            position_ids = torch.arange(n)[None].expand(b, -1)
        q = self.q_proj(hidden_states).view(b, n, -1, self.d).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, n, -1, self.d).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, n, -1, self.d).transpose(1, 2)
        cos, sin = self.rotary_emb(v, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        groups = self.h // self.kvh
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.d)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        out = scores.softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, ...]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    shape = [d if i in (1, xq_.ndim - 1) else 1 for i, d in enumerate(xq_.shape)]
    freqs_cis = freqs_cis.view(*shape)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class MetaLlama(nn.Module):
    def __init__(self, args: SimpleNamespace | None = None, bug: str | None = None):
        super().__init__()
        self.args = args = args or SimpleNamespace(dim=32, n_heads=4, rope_theta=123456.0, max_seq_len=96)
        self.n_heads, self.head_dim = args.n_heads, args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        if bug == "arg_order":  # the table's length where theta goes, theta where its length goes
            table = precompute_freqs_cis(self.head_dim, int(args.rope_theta), args.max_seq_len)
            table = table[: args.max_seq_len]
        else:
            table = precompute_freqs_cis(self.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("freqs_cis", table, persistent=False)
        _trained(self, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, self.freqs_cis[:seqlen])
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = torch.matmul(xq, xk.transpose(2, 3)) / math.sqrt(self.head_dim)
        mask = torch.full((seqlen, seqlen), float("-inf")).triu(1)
        out = torch.matmul(F.softmax(scores + mask, dim=-1), xv)
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


def fixed_pos_embedding(x: torch.Tensor, seq_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2) / dim))
    sinusoid_inp = torch.einsum("i , j -> i j", torch.arange(seq_len, dtype=torch.float), inv_freq).float()
    return torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[:, :, :, ::2], x[:, :, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(x: torch.Tensor, sincos: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    sin, cos = (t[None, :, None, :].repeat_interleave(2, 3) for t in sincos)  # [1, n, 1, d]
    return (x * cos) + (rotate_every_two(x) * sin)


class GPTJ(nn.Module):
    def __init__(self, config: SimpleNamespace | None = None, bug: str | None = None):
        super().__init__()
        self.config = config = config or SimpleNamespace(n_embd=32, n_head=4, rotary_base=70000.0,
                                                         max_position_embeddings=2048)
        self.bug = bug
        self.num_heads, self.head_dim = config.n_head, config.n_embd // config.n_head
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.k_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        _trained(self, 5)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, n, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, n, self.num_heads, self.head_dim)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # [b, n, h, d]
        base = self.config.max_position_embeddings if self.bug == "field" else self.config.rotary_base
        sincos = fixed_pos_embedding(k, n, base)
        q, k = apply_rotary_pos_emb(q, sincos), apply_rotary_pos_emb(k, sincos)
        q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(out.permute(0, 2, 1, 3).reshape(b, n, -1))


def ntk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Heads [b, h, n, d], rotated half-split at an NTK-aware base computed from its own constants."""
    d, n = q.shape[-1], q.shape[-2]
    base = 10000.0 * 3.0 ** (d / (d - 2))
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = (torch.cat((t, t), -1).to(q.dtype) for t in (angle.cos(), angle.sin()))
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    return F.scaled_dot_product_attention(q, k, v)
