"""Styles for tests/test_trace_tablenames.py: RoPE's table handed in under names other code gives it. Lingua is
Meta's lingua `Attention`: `forward(x, freq_cis, tok_idx=None, mask=None, attn_impl="sdpa")`, the table 2x2 rotation
matrices `[S, d_head / 2, 2, 2]` (its precompute_freqs_cis stacks cos, -sin, sin, cos) checked by an assert before
use and applied as `(xq_ * freqs_cis).sum(5)` on adjacent pairs, GQA by `repeat_kv` on dim 2, the mask the string
"causal" for SDPA's `is_causal`. MiniMind is minimind's LLaMA-like `Attention`: `forward(x, pos_cis, ...)`, the
table Meta's complex one `[S, d_head / 2]`, its own causal `-inf` buffer added, the softmax in float32. `bug=` plants
a mistake: 'q_only' (the keys never rotated: rope.not_applied), 'scale_model' (divided by √d_model: scale.d_model)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _moved(module: nn.Module, seed: int) -> None:
    """Every weight off its initial value (trained-looking), the same in each instance of a class."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def repeat_kv(x: torch.Tensor, n_rep: int, dim: int) -> torch.Tensor:
    assert dim == 2, "Only dim=2 is supported. Check the implementation for other dims."
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(
        bs, slen, n_kv_heads * n_rep, head_dim)


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor, seq_dim: int) -> torch.Tensor:
    ndim = x.ndim
    assert 0 <= seq_dim < ndim
    assert freqs_cis.shape == (x.shape[seq_dim], x.shape[-3], 2, 2), f"freqs_cis vs x: {(freqs_cis.shape, x.shape)}"
    shape = [d if i == seq_dim or i == ndim - 3 else 1 for i, d in enumerate(x.shape[:-2])] + [2, 2]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, seq_dim, freqs_cis, q_only=False):
    xq_ = xq.reshape(*xq.shape[:-1], -1, 1, 2)  # B S H D -> B S H D/2 1 2
    xk_ = xk.reshape(*xk.shape[:-1], -1, 1, 2)
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_, seq_dim).float()  # S D/2 2 2 -> 1 S 1 D/2 2 2
    xq_out = (xq_ * freqs_cis).sum(5).flatten(3)
    xk_out = xk if q_only else (xk_ * freqs_cis).sum(5).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Lingua(nn.Module):
    def __init__(self, dim=32, head_dim=8, n_heads=4, n_kv_heads=2, rope_theta=10000.0, bug=None):
        super().__init__()
        self.dim, self.head_dim, self.rope_theta, self.bug = dim, head_dim, rope_theta, bug
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.heads_per_group = n_heads // n_kv_heads
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        _moved(self, 761)

    def forward(self, x, freq_cis, tok_idx=None, mask=None, attn_impl="sdpa"):
        bsz, seq_len, dim = x.shape
        xq, xk, xv = self.wq(x.view_as(x)), self.wk(x.view_as(x)), self.wv(x.view_as(x))
        output_shape = xq.shape
        xq = xq.view(bsz, seq_len, self.n_heads, self.head_dim)
        xk = xk.view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        xv = xv.view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, 1, freq_cis[0:seq_len], q_only=self.bug == "q_only")
        xk = repeat_kv(xk, self.heads_per_group, dim=2)
        xv = repeat_kv(xv, self.heads_per_group, dim=2)
        xq, xk, xv = (e.transpose(1, 2) for e in (xq, xk, xv))
        is_causal = (mask == "causal") if isinstance(mask, str) else False
        mask = mask if isinstance(mask, torch.Tensor) else None
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=is_causal, attn_mask=mask)
        output = output.transpose(1, 2).contiguous()
        return self.wo(output.reshape(output_shape))


class MiniMind(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_seq_len=64, bug=None):
        super().__init__()
        self.n_local_heads, self.n_local_kv_heads = num_attention_heads, num_key_value_heads
        self.n_rep = num_attention_heads // num_key_value_heads
        self.head_dim, self.bug, self.hidden_size = hidden_size // num_attention_heads, bug, hidden_size
        self.wq = nn.Linear(hidden_size, num_attention_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(num_attention_heads * self.head_dim, hidden_size, bias=False)
        _moved(self, 762)
        mask = torch.full((1, 1, max_seq_len, max_seq_len), float("-inf"))
        self.register_buffer("mask", torch.triu(mask, diagonal=1), persistent=False)

    @staticmethod
    def apply_rotary_emb(xq, xk, pos_cis):
        def unite_shape(pos_cis, x):
            ndim = x.ndim
            assert pos_cis.shape == (x.shape[1], x.shape[-1])
            shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
            return pos_cis.view(*shape)

        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        pos_cis = unite_shape(pos_cis, xq_)
        xq_out = torch.view_as_real(xq_ * pos_cis).flatten(3)
        xk_out = torch.view_as_real(xk_ * pos_cis).flatten(3)
        return xq_out.type_as(xq), xk_out.type_as(xk)

    def forward(self, x, pos_cis, past_key_value=None, use_cache=False):
        bsz, seq_len, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seq_len, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seq_len, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seq_len, self.n_local_kv_heads, self.head_dim)
        xq, xk = self.apply_rotary_emb(xq, xk, pos_cis)
        xq, xk, xv = (xq.transpose(1, 2), repeat_kv(xk, self.n_rep, 2).transpose(1, 2),
                      repeat_kv(xv, self.n_rep, 2).transpose(1, 2))
        width = self.hidden_size if self.bug == "scale_model" else self.head_dim
        scores = (xq @ xk.transpose(-2, -1)) / math.sqrt(width)
        scores += self.mask[:, :, :seq_len, :seq_len]
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = scores @ xv
        output = output.transpose(1, 2).reshape(bsz, seq_len, -1)
        return self.wo(output), None
