"""Styles for tests/test_trace_round34_forms.py (held-out round 34): gpt-fast's Attention, its `freqs_cis` a real
table `stack([cos, sin], -1)` [n_Q, d_head / 2, 2] viewed as pairs; a GPT-NeoX-like partial rotary
(`q[..., :rotary_ndims]` turned, rotate_half); BLIP's text self-attention used as cross-attention, its memory's
padding in `encoder_attention_mask` beside `attention_mask`. `bug=` plants a mistake."""

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


def apply_rotary_emb(x, freqs_cis):
    """gpt-fast's: x [b, s, h, d] in pairs (2i, 2i + 1), freqs_cis [s, d / 2, 2] (cos, sin)."""
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack([xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
                          xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1]], -1)
    return x_out2.flatten(3).type_as(x)


class GptFastAttention(nn.Module):
    """gpt-fast's `Attention(x, freqs_cis, mask)`: a fused wqkv split [dim, kv, kv], GQA by repeat_interleave,
    F.scaled_dot_product_attention under the caller's boolean mask. 'gqa_repeat' tiles the key/value heads."""

    def __init__(self, dim=64, n_head=4, n_local_heads=2, bug=None):
        super().__init__()
        self.bug, self.dim, self.n_head, self.n_local_heads = bug, dim, n_head, n_local_heads
        self.head_dim = dim // n_head
        self.wqkv = nn.Linear(dim, (n_head + 2 * n_local_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        _moved(self, 41)

    def forward(self, x, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        q = apply_rotary_emb(q.view(bsz, seqlen, self.n_head, self.head_dim), freqs_cis)
        k = apply_rotary_emb(k.view(bsz, seqlen, self.n_local_heads, self.head_dim), freqs_cis)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        group = self.n_head // self.n_local_heads
        if self.bug == "gqa_repeat":
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        else:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class PartialRotary(nn.Module):
    """GPT-NeoX-like: the first rotary_ndims = d_head · rotary_pct of each head turned (rotate_half, base 10000),
    the rest passed through, a causal tril of its own. 'last_share' turns the last rotary_ndims instead."""

    def __init__(self, hidden_size=64, num_heads=4, rotary_pct=0.5, bug=None):
        super().__init__()
        self.bug, self.h = bug, num_heads
        self.d = hidden_size // num_heads
        self.rotary_ndims = int(self.d * rotary_pct)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        _moved(self, 42)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        q, k, v = (t.view(b, n, self.h, self.d).transpose(1, 2) for t in self.qkv(hidden_states).chunk(3, dim=-1))
        r = self.rotary_ndims
        inv_freq = 1.0 / 10000 ** (torch.arange(0, r, 2, dtype=torch.float32) / r)
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()

        def turn(x):
            if self.bug == "last_share":
                kept, part = x[..., :-r], x[..., -r:]
                return torch.cat((kept, part * cos + rotate_half(part) * sin), dim=-1)
            part, kept = x[..., :r], x[..., r:]
            return torch.cat((part * cos + rotate_half(part) * sin, kept), dim=-1)

        q, k = turn(q), turn(k)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        weights = scores.masked_fill(~causal, torch.finfo(scores.dtype).min).softmax(-1)
        return self.dense((weights @ v).transpose(1, 2).reshape(b, n, -1))


class BlipCross(nn.Module):
    """BLIP's text self-attention as cross-attention: keys and values from encoder_hidden_states of another width,
    `attention_mask = encoder_attention_mask` there (additive), no output projection. 'encoder_mask_ignored' keeps
    the queries' attention_mask in the cross branch."""

    def __init__(self, hidden_size=32, encoder_hidden_size=48, num_attention_heads=4, bug=None):
        super().__init__()
        self.bug, self.h = bug, num_attention_heads
        self.d = hidden_size // num_attention_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(encoder_hidden_size, hidden_size)
        self.value = nn.Linear(encoder_hidden_size, hidden_size)
        _moved(self, 43)

    def _heads(self, x):
        return x.view(*x.shape[:-1], self.h, self.d).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, head_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None):
        query = self._heads(self.query(hidden_states))
        if encoder_hidden_states is not None:
            key = self._heads(self.key(encoder_hidden_states))
            value = self._heads(self.value(encoder_hidden_states))
            if self.bug != "encoder_mask_ignored":
                attention_mask = encoder_attention_mask
        else:
            key, value = self._heads(self.key(hidden_states)), self._heads(self.value(hidden_states))
        scores = query @ key.transpose(-1, -2) / math.sqrt(self.d)
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = scores.softmax(dim=-1)
        if head_mask is not None:
            probs = probs * head_mask
        out = (probs @ value).permute(0, 2, 1, 3)
        return out.reshape(*out.shape[:-2], -1)
