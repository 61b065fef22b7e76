"""RoPE and softmax conventions of round 12's libraries, for tests/test_trace_r12_rope.py; each correct one is checked
there against a float64 formula or F.scaled_dot_product_attention, each planted bug (`bug=`) shown to change the
output.

RoPE turned by −θ (each pair (a, b) to (a·cos + b·sin, −a·sin + b·cos), the transpose of the usual turn: q·k then
depends on j − i, a relative position all the same):
- `MinusHalves`: nanochat's form, `x1 * cos + x2 * sin`, `x1 * (-sin) + x2 * cos` on the halves, its own tables
  [1, T, 1, d_head / 2] as buffers, a weight-free `F.rms_norm` on q and k after RoPE, GQA by SDPA's `enable_gqa`,
  and a decode step whose cache is a `(k, v)` tuple joined after RoPE; bugs `tiled` (the kv heads by `.repeat`:
  gqa.tiled), `new_first` (cache.order), `no_offset` (the new positions from 0: rope.positions), `is_causal`
  (SDPA's is_causal=True in a chunk decode: mask.upper_left);
- `ConjComplex`: Meta's complex form with the table conjugated, `view_as_complex(x) * freqs_cis.conj()`
  (interleaved pairs), matmul scores and a causal mask; bugs `no_scale` (scale.none), `kv_swapped`;
- `MinusRotateHalf`: transformers' `rotate_half` with the sign moved, `x * cos - rotate_half(x) * sin`, full-width
  `cat(freqs, freqs)` tables, folded heads and `baddbmm`; bug `q_only` (only q turned by −θ, k by +θ: no
  relative position, never a convention).

RoPE's tables handed as a `(cos, sin)` pair in one parameter of the code's own name:
- `CosSinPair`: nanochat's `forward(x, cos_sin, kv_cache)`, `cos, sin = cos_sin`, each [1, T, 1, d_head / 2] (one
  angle a pair, broadcast over each half of q [B, T, H, D]), turned by −θ;
- `IndexedRotary`: `forward(hidden_states, rotary)` reading `rotary[0]`, `rotary[1]`, transformers' tables
  [B, T, d_head] unsqueezed over the heads, `rotate_half`; bug `no_scale` (scale.none);
- `EvenOddFreqs`: `forward(x, freqs)`, `cos, sin = freqs`, [T, d_head / 2], pairs (2i, 2i + 1) taken apart with
  `x[..., ::2]`, `x[..., 1::2]` and stacked back.

Tables half the head wide, one angle a pair over the halves (GPT-OSS's `_apply_rotary_emb`):
- `SplitHalves`: `position_embeddings` [B, T, d_head / 2] unsqueezed, `torch.split(x, d // 2, -1)`, no sinks;
- `SeparateHalfTables`: `forward(x, cos, sin)`, each [T, d_head / 2], q [B, T, H, D] (the tables broadcast along
  its own axes).

Attention sinks, a learned logit a head joined to the scores before the softmax and dropped after:
- `GptOssSinks`: transformers' `GptOssAttention` + `eager_attention_forward` (biases, repeat_kv, chunked half-width
  RoPE, `cat([scores + mask, sinks])`, the row's max taken out, `probs[..., :-1]`); `sinks_init` sets the sinks (-1e4:
  they weigh nothing); bugs `kv_swapped`, `mask_after_softmax`, `scale_d_model`;
- `SinkFirst`: the sink column prepended, `cat([sink, scores])`, softmax, `[..., 1:]`, a parameter named
  `sink_logits`, no RoPE; bug `no_scale` (scale.none);
- `EinsumSinks`: einsum scores, GQA by repeat_interleave, `torch.cat((scores, s), -1).softmax(-1)[..., :-1]` without
  the max; bug `tiled` (gqa.tiled).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _angles(n, d, base=10000.0):  # [n, d / 2]
    return torch.arange(n, dtype=torch.float32)[:, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)


# --- RoPE by −θ -----------------------------------------------------------------------------------------------


def _minus_halves(x, cos, sin):
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], -1)


class MinusHalves(nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=2, bug=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.bug = heads, kv_heads, dim // heads, bug
        self.c_q = nn.Linear(dim, dim, bias=False)
        self.c_k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.c_v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.c_proj = nn.Linear(dim, dim, bias=False)
        angles = _angles(64, self.head_dim)
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)

    def forward(self, x, kv_cache=None):
        B, T, _ = x.shape
        T0 = 0 if kv_cache is None or self.bug == "no_offset" else kv_cache[0].size(2)
        cos, sin = self.cos[:, T0:T0 + T], self.sin[:, T0:T0 + T]
        q = self.c_q(x).view(B, T, self.heads, self.head_dim)
        k = self.c_k(x).view(B, T, self.kv_heads, self.head_dim)
        v = self.c_v(x).view(B, T, self.kv_heads, self.head_dim)
        q, k = _minus_halves(q, cos, sin), _minus_halves(k, cos, sin)
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv_cache is not None:
            first = (k, kv_cache[0]) if self.bug == "new_first" else (kv_cache[0], k)
            k = torch.cat(first, dim=2)
            v = torch.cat((v, kv_cache[1]) if self.bug == "new_first" else (kv_cache[1], v), dim=2)
        gqa = True
        if self.bug == "tiled":
            k, v = k.repeat(1, self.heads // self.kv_heads, 1, 1), v.repeat(1, self.heads // self.kv_heads, 1, 1)
            gqa = False
        Tq, Tk = q.size(2), k.size(2)
        if Tq == Tk or self.bug == "is_causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            keep = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=gqa)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class ConjComplex(nn.Module):
    def __init__(self, dim=24, n_heads=3, bug=None):
        super().__init__()
        self.n_heads, self.head_dim, self.bug = n_heads, dim // n_heads, bug
        self.wq, self.wk = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.wv, self.wo = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.register_buffer("freqs_cis", torch.polar(torch.ones(64, self.head_dim // 2), _angles(64, self.head_dim)),
                             persistent=False)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = (w(x).view(bsz, seqlen, self.n_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        turn = self.freqs_cis[:seqlen].conj()[None, :, None, :]
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        xq = torch.view_as_real(xq_ * turn).flatten(3).type_as(xq)
        xk = torch.view_as_real(xk_ * turn).flatten(3).type_as(xk)
        if self.bug == "kv_swapped":
            xk, xv = xv, xk
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = q @ k.transpose(2, 3)
        if self.bug != "no_scale":
            scores = scores / math.sqrt(self.head_dim)
        mask = torch.full((seqlen, seqlen), float("-inf")).triu(1)
        out = F.softmax(scores + mask, dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class MinusRotateHalf(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        self.query = nn.Linear(embed_dim, embed_dim)
        self.key = nn.Linear(embed_dim, embed_dim)
        self.value = nn.Linear(embed_dim, embed_dim)
        self.dense = nn.Linear(embed_dim, embed_dim)
        angles = _angles(64, self.head_dim)
        emb = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        cos, sin = self.cos_cached[:n], self.sin_cached[:n]

        def fold(t):  # [b, n, h·d] -> [b·h, n, d]
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2).reshape(b * self.num_heads, n, -1)

        q, k, v = fold(self.query(hidden_states)), fold(self.key(hidden_states)), fold(self.value(hidden_states))
        q = q * cos - _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin if self.bug == "q_only" else k * cos - _rotate_half(k) * sin
        bias = torch.zeros(n, n, dtype=q.dtype).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        scores = torch.baddbmm(bias.expand(b * self.num_heads, n, n), q, k.transpose(1, 2), alpha=self.head_dim ** -0.5)
        out = torch.bmm(scores.softmax(-1), v).view(b, self.num_heads, n, -1).transpose(1, 2).reshape(b, n, -1)
        return self.dense(out)


# --- a (cos, sin) pair in one parameter -------------------------------------------------------------------------


def _half_tables(n, d, base=10000.0):  # [n, d / 2] each: one angle a pair, the frequencies over the whole head
    angles = _angles(n, d, base)
    return angles.cos(), angles.sin()


class CosSinPair(nn.Module):
    def __init__(self, n_embd=32, n_head=4, n_kv_head=2):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, n_embd // n_head
        self.c_q = nn.Linear(n_embd, n_embd, bias=False)
        self.c_k = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x, cos_sin, kv_cache=None):
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = cos_sin
        q, k = _minus_halves(q, cos, sin), _minus_halves(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class IndexedRotary(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, rotary):
        b, n, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, n, self.num_heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = rotary[0].unsqueeze(1), rotary[1].unsqueeze(1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        scores = q @ k.transpose(-1, -2)
        if self.bug != "no_scale":
            scores = scores * self.head_dim ** -0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = scores.softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class EvenOddFreqs(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, freqs):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        cos, sin = freqs

        def turn(t):
            even, odd = t[..., ::2], t[..., 1::2]
            return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)

        out = F.scaled_dot_product_attention(turn(q), turn(k), v, is_causal=True)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


# --- tables half the head wide ------------------------------------------------------------------------------------


def _halves_turned(x, cos, sin):  # GPT-OSS's _apply_rotary_emb, written with split
    first, second = torch.split(x, x.shape[-1] // 2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class SplitHalves(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, num_kv_heads=2):
        super().__init__()
        self.num_heads, self.num_kv, self.head_dim = num_heads, num_kv_heads, hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=True)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=True)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, n, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, n, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = _halves_turned(q, cos.unsqueeze(1), sin.unsqueeze(1)), _halves_turned(k, cos.unsqueeze(1),
                                                                                      sin.unsqueeze(1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class SeparateHalfTables(nn.Module):
    def __init__(self, dim=32, n_heads=4):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.wv, self.wo = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = (w(x).view(bsz, seqlen, self.n_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2] over [B, T, H, D/2]
        xq, xk = _halves_turned(xq, cos, sin), _halves_turned(xk, cos, sin)
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


# --- attention sinks ----------------------------------------------------------------------------------------------


def _repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class GptOssSinks(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=150000.0,
                 bug=None, sinks_init=None):
        super().__init__()
        self.head_dim, self.bug, self.rope_theta = head_dim, bug, rope_theta
        self.num_key_value_groups = num_attention_heads // num_key_value_heads
        self.scaling = (hidden_size if bug == "scale_d_model" else head_dim) ** -0.5
        self.q_proj = nn.Linear(hidden_size, num_attention_heads * head_dim, bias=True)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=True)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=True)
        self.o_proj = nn.Linear(num_attention_heads * head_dim, hidden_size, bias=True)
        self.sinks = nn.Parameter(torch.randn(num_attention_heads) if sinks_init is None
                                  else torch.full((num_attention_heads,), float(sinks_init)))

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        turned = []
        for x in (query, key):
            first_half, second_half = torch.chunk(x, 2, dim=-1)
            turned.append(torch.cat((first_half * cos - second_half * sin, second_half * cos + first_half * sin), -1))
        query, key = turned
        key_states = _repeat_kv(key, self.num_key_value_groups)
        value_states = _repeat_kv(value, self.num_key_value_groups)
        if self.bug == "kv_swapped":
            key_states, value_states = value_states, key_states
        attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None and self.bug != "mask_after_softmax":
            attn_weights = attn_weights + attention_mask
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
        combined_logits = torch.cat([attn_weights, sinks], dim=-1)
        combined_logits = combined_logits - combined_logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined_logits, dim=-1, dtype=combined_logits.dtype)
        scores = probs[..., :-1]
        if attention_mask is not None and self.bug == "mask_after_softmax":
            scores = scores + attention_mask
        attn_output = torch.matmul(scores, value_states).transpose(1, 2).contiguous()
        return self.o_proj(attn_output.reshape(*input_shape, -1).contiguous()), scores


class SinkFirst(nn.Module):
    def __init__(self, d_model=32, n_heads=4, bug=None):
        super().__init__()
        self.n_heads, self.d_k, self.bug = n_heads, d_model // n_heads, bug
        self.W_q, self.W_k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.W_v, self.W_o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.sink_logits = nn.Parameter(torch.randn(n_heads))

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        q, k, v = (w(x).view(b, n, self.n_heads, self.d_k).transpose(1, 2) for w in (self.W_q, self.W_k, self.W_v))
        scores = q @ k.transpose(-2, -1)
        if self.bug != "no_scale":
            scores = scores / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        sink = self.sink_logits.view(1, -1, 1, 1).expand(b, -1, n, 1)
        weights = torch.softmax(torch.cat([sink, scores], dim=-1), dim=-1)[..., 1:]
        return self.W_o((weights @ v).transpose(1, 2).reshape(b, n, -1))


class EinsumSinks(nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=2, bug=None):
        super().__init__()
        self.heads, self.kv_heads, self.dh, self.bug = heads, kv_heads, dim // heads, bug
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, 2 * kv_heads * self.dh, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)
        self.s = nn.Parameter(torch.randn(heads))

    def forward(self, x):
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.heads, self.dh)
        k, v = (t.view(b, n, self.kv_heads, self.dh) for t in self.to_kv(x).chunk(2, dim=-1))
        rep = self.heads // self.kv_heads
        if self.bug == "tiled":
            k, v = k.repeat(1, 1, rep, 1), v.repeat(1, 1, rep, 1)
        else:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bihd,bjhd->bhij", q, k) * self.dh ** -0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        s = self.s[None, :, None, None].expand(b, self.heads, n, 1)
        attn = torch.cat((scores, s), dim=-1).softmax(dim=-1)[..., :-1]
        out = torch.einsum("bhij,bjhd->bihd", attn, v)
        return self.to_out(out.reshape(b, n, -1))
