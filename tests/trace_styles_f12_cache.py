"""Decode steps whose cache comes another way than one `(k, v)` tuple or tensor, for tests/test_trace_f12_cache.py;
each correct one and each planted bug (`bug=`) is checked there against F.scaled_dot_product_attention in float64,
and each bug shown to change the output.

The cache as two parameters of the forward:
- `PastKeyValueArgs`: `forward(hidden_states, attention_mask=None, past_key=None, past_value=None)`, transformers'
  layout [n_batch, n_head, n_cache, d_head] joined on dim 2, an additive mask; bugs `new_first` (cache.order),
  `is_causal` (SDPA's is_causal=True: mask.upper_left), `no_scale` (scale.none);
- `SeqMajorArgs`: `forward(x, k_cache=None, v_cache=None)`, GQA, each [n_batch, n_cache, n_kv_head, d_head]
  (mistral-inference's) joined on dim 1, heads repeated by repeat_interleave, a hand-made lower-right mask;
  bugs `new_first`, `is_causal`, `tiled` (gqa.tiled).

The cache as a dict:
- `DictCache`: `forward(x, cache=None)` with `cache["k"]`, `cache["v"]` [n_batch, n_head, n_cache, d_head],
  einsum scores; bugs `new_first`, `is_causal`, `no_scale`;
- `LayerPastDict`: `layer_past={"key": .., "value": ..}` read with `.get`, heads folded into the batch
  [n_batch·n_head, n_cache, d_head], bmm, masked_fill; bugs `new_first`, `upper_left` (a tril of the square's
  diagonal: mask.upper_left), `no_scale`.

GPTBigCode's fused cache, keys and values on one last axis:
- `FusedMQACache`: multi-query (one key/value head), `c_attn` writing q | k | v, `layer_past` [n_batch, n_cache,
  2·d_head] joined on dim -2 and split `(d_head, d_head)` on dim -1, the queries' heads folded into the rows
  (`[b, q·h, d]`, baddbmm); bugs `new_first`, `is_causal`, `no_scale`;
- `FusedHeadsCache`: every head its own keys and values, `layer_past` [n_batch, n_head, n_cache, 2·d_head] chunked in
  two on dim -1, SDPA; bugs `new_first`, `is_causal`, `values_first` (the split read v | k: kv.swapped).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _heads(t, h):  # [B, T, h·d] -> [B, h, T, d]
    return t.view(*t.shape[:2], h, -1).transpose(1, 2)


def _allowed(n_q, n_k):  # lower-right causal: the new queries after the cached positions, True = may attend
    return torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)


# --- the cache as two parameters ------------------------------------------------------------------------------


class PastKeyValueArgs(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask=None, past_key=None, past_value=None):
        bsz, q_len, _ = hidden_states.shape
        query = _heads(self.q_proj(hidden_states), self.num_heads)
        key = _heads(self.k_proj(hidden_states), self.num_heads)
        value = _heads(self.v_proj(hidden_states), self.num_heads)
        if past_key is not None:
            if self.bug == "new_first":
                key, value = torch.cat([key, past_key], dim=2), torch.cat([value, past_value], dim=2)
            else:
                key, value = torch.cat([past_key, key], dim=2), torch.cat([past_value, value], dim=2)
        if self.bug == "is_causal":
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                 scale=1.0 if self.bug == "no_scale" else None)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class SeqMajorArgs(nn.Module):
    def __init__(self, dim=32, n_heads=4, n_kv_heads=2, bug=None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.bug = n_heads, n_kv_heads, dim // n_heads, bug
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, k_cache=None, v_cache=None):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if k_cache is not None:
            first = self.bug == "new_first"
            xk = torch.cat((xk, k_cache) if first else (k_cache, xk), dim=1)
            xv = torch.cat((xv, v_cache) if first else (v_cache, xv), dim=1)
        repeats = self.n_heads // self.n_kv_heads
        if self.bug == "tiled":
            keys, values = xk.repeat(1, 1, repeats, 1), xv.repeat(1, 1, repeats, 1)
        else:
            keys, values = xk.repeat_interleave(repeats, dim=2), xv.repeat_interleave(repeats, dim=2)
        q, k, v = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        if self.bug == "is_causal":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=_allowed(seqlen, k.shape[2]))
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


# --- the cache as a dict ----------------------------------------------------------------------------------------


class DictCache(nn.Module):
    def __init__(self, d_model=32, n_head=4, bug=None):
        super().__init__()
        self.n_head, self.d_head, self.bug = n_head, d_model // n_head, bug
        self.to_q = nn.Linear(d_model, d_model, bias=False)
        self.to_k = nn.Linear(d_model, d_model, bias=False)
        self.to_v = nn.Linear(d_model, d_model, bias=False)
        self.to_out = nn.Linear(d_model, d_model)

    def forward(self, x, cache=None):
        b, n, _ = x.shape
        q, k, v = (_heads(f(x), self.n_head) for f in (self.to_q, self.to_k, self.to_v))
        if cache is not None:
            pair = ((k, cache["k"]), (v, cache["v"])) if self.bug == "new_first" else ((cache["k"], k), (cache["v"], v))
            k, v = (torch.cat(p, dim=-2) for p in pair)
        if self.bug == "is_causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scale = 1.0 if self.bug == "no_scale" else self.d_head ** -0.5
            dots = torch.einsum("bhid,bhjd->bhij", q, k) * scale
            dots = dots.masked_fill(~_allowed(n, k.shape[-2]), -torch.finfo(dots.dtype).max)
            y = torch.einsum("bhij,bhjd->bhid", dots.softmax(dim=-1), v)
        return self.to_out(y.transpose(1, 2).reshape(b, n, -1))


class LayerPastDict(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        self.scaling = 1.0 if bug == "no_scale" else self.head_dim ** -0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _shape(self, t, bsz):  # [B, T, E] -> [B·H, T, D]
        return t.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2).reshape(bsz * self.num_heads, -1,
                                                                                      self.head_dim)

    def forward(self, hidden_states, layer_past=None):
        bsz, tgt_len, embed_dim = hidden_states.shape
        q = self._shape(self.q_proj(hidden_states) * self.scaling, bsz)
        k = self._shape(self.k_proj(hidden_states), bsz)
        v = self._shape(self.v_proj(hidden_states), bsz)
        if layer_past is not None:
            prev_key, prev_value = layer_past.get("key"), layer_past.get("value")
            if self.bug == "new_first":
                k, v = torch.cat([k, prev_key], dim=1), torch.cat([v, prev_value], dim=1)
            else:
                k, v = torch.cat([prev_key, k], dim=1), torch.cat([prev_value, v], dim=1)
        src_len = k.size(1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))  # [B·H, T, S]
        if self.bug == "upper_left":
            future = torch.ones(tgt_len, src_len, dtype=torch.bool).triu(1)
        else:
            future = ~_allowed(tgt_len, src_len)
        attn_weights = attn_weights.masked_fill(future, float("-inf"))
        attn_output = torch.bmm(F.softmax(attn_weights, dim=-1), v)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        return self.out_proj(attn_output.reshape(bsz, tgt_len, embed_dim))


# --- GPTBigCode's fused cache -------------------------------------------------------------------------------------


class FusedMQACache(nn.Module):
    def __init__(self, n_embd=32, n_head=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.embed_dim, self.bug = n_head, n_embd // n_head, n_embd, bug
        self.c_attn = nn.Linear(n_embd, n_embd + 2 * self.head_dim)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, hidden_states, layer_past=None):
        query, key_value = self.c_attn(hidden_states).split((self.embed_dim, 2 * self.head_dim), dim=2)
        if layer_past is not None:
            parts = (key_value, layer_past) if self.bug == "new_first" else (layer_past, key_value)
            key_value = torch.cat(parts, dim=-2)
        present = key_value  # noqa: F841  (what GPTBigCode hands back with use_cache)
        key, value = key_value.split((self.head_dim, self.head_dim), dim=-1)
        batch_size, query_length = query.shape[0], query.shape[1]
        key_length = key.size(-2)
        query = query.reshape(batch_size, query_length * self.num_heads, self.head_dim)  # [b, q·h, d]
        if self.bug == "is_causal":
            q4 = query.view(batch_size, query_length, self.num_heads, self.head_dim).transpose(1, 2)
            out = F.scaled_dot_product_attention(q4, key.unsqueeze(1), value.unsqueeze(1), is_causal=True)
            attn_output = out.transpose(1, 2).reshape(batch_size, query_length, self.embed_dim)
            return self.c_proj(attn_output)
        scale = 1.0 if self.bug == "no_scale" else 1 / math.sqrt(self.head_dim)
        empty = torch.empty(batch_size, query_length * self.num_heads, key_length)
        attn_weights = torch.baddbmm(empty, query, key.transpose(-1, -2), beta=0, alpha=scale)
        attn_weights = attn_weights.view(batch_size, query_length, self.num_heads, key_length)
        mask = _allowed(query_length, key_length)[None, :, None, :]  # [1, q, 1, k]
        attn_weights = torch.where(mask, attn_weights, torch.finfo(attn_weights.dtype).min)
        attn_weights = F.softmax(attn_weights, dim=-1).view(batch_size, query_length * self.num_heads, key_length)
        attn_output = torch.bmm(attn_weights, value).view(batch_size, query_length, self.embed_dim)
        return self.c_proj(attn_output)


class FusedHeadsCache(nn.Module):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.dim_head, self.bug = heads, dim // heads, bug
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, 2 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, layer_past=None):
        b, n, _ = x.shape
        q = _heads(self.to_q(x), self.heads)
        k, v = (_heads(t, self.heads) for t in self.to_kv(x).chunk(2, dim=-1))
        kv = torch.cat((k, v), dim=-1)  # [b, h, n, 2·d]
        if layer_past is not None:
            kv = torch.cat((kv, layer_past) if self.bug == "new_first" else (layer_past, kv), dim=2)
        k, v = kv.chunk(2, dim=-1)
        if self.bug == "values_first":
            v, k = k, v
        if self.bug == "is_causal":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=_allowed(n, k.shape[2]))
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


# --- a cache the module holds itself ----------------------------------------------------------------------------


class KVCache(nn.Module):  # gpt-fast's: buffers [B, H, max_len, D], written at input_pos, handed back whole
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim):
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape))
        self.register_buffer("v_cache", torch.zeros(shape))

    def update(self, input_pos, k_val, v_val):
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val
        return k_out, v_out


class GptFastHeld(nn.Module):
    def __init__(self, dim=32, n_head=4, n_local_heads=2, max_batch_size=2, max_seq_length=16, bug=None):
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim, self.dim, self.bug = n_head, n_local_heads, dim // n_head, \
            dim, bug
        self.wqkv = nn.Linear(dim, (n_head + 2 * n_local_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.kv_cache = KVCache(max_batch_size, max_seq_length, n_local_heads, self.head_dim)

    def forward(self, x, mask, input_pos=None):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim).transpose(1, 2)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        rep = self.n_head // self.n_local_heads
        if self.bug == "tiled":
            k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
        else:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.bug == "is_causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim))


class IndexCopyHeld(nn.Module):
    """torchtune-like: the cache written with index_copy_ at input_pos, read back up to the last new position."""

    def __init__(self, embed_dim=32, num_heads=4, max_seq_len=16, batch_size=2, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.output_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        shape = (batch_size, num_heads, max_seq_len, self.head_dim)
        self.register_buffer("cache_k", torch.zeros(shape), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape), persistent=False)

    def forward(self, x, *, mask=None, input_pos=None):
        b, s, _ = x.shape
        q, k, v = (_heads(f(x), self.num_heads) for f in (self.q_proj, self.k_proj, self.v_proj))
        self.cache_k.index_copy_(2, input_pos, k)
        self.cache_v.index_copy_(2, input_pos, v)
        if self.bug == "new_first":  # the cached positions joined after the new ones
            start = int(input_pos[0])
            k = torch.cat([k, self.cache_k[:, :, :start]], dim=2)
            v = torch.cat([v, self.cache_v[:, :, :start]], dim=2)
        else:
            end = int(input_pos[-1]) + 1
            k, v = self.cache_k[:, :, :end], self.cache_v[:, :, :end]
        scale = 1.0 if self.bug == "no_scale" else None
        if self.bug == "is_causal":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return self.output_proj(out.transpose(1, 2).reshape(b, s, -1))


class StartPosHeld(nn.Module):
    """Meta-llama-like: plain tensor attributes [max_batch, max_seq, n_kv_heads, head_dim] written at start_pos, its
    own RoPE table (half-split cos/sin) sliced at start_pos, GQA by repeat_interleave, an additive mask built in."""

    def __init__(self, dim=32, n_heads=4, n_kv_heads=2, max_batch_size=2, max_seq_len=16, base=10000.0, bug=None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.bug = n_heads, n_kv_heads, dim // n_heads, bug
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.cache_k = torch.zeros(max_batch_size, max_seq_len, n_kv_heads, self.head_dim)
        self.cache_v = torch.zeros(max_batch_size, max_seq_len, n_kv_heads, self.head_dim)
        inv_freq = 1.0 / base ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(4 * max_seq_len).float(), inv_freq)
        self.register_buffer("cos", torch.cat([angles, angles], -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat([angles, angles], -1).sin(), persistent=False)

    def _rotate(self, t, cos, sin):  # t [B, T, H, D], half-split
        half = t.shape[-1] // 2
        turned = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return t * cos[None, :, None] + turned * sin[None, :, None]

    def forward(self, x, start_pos=0):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        first = 0 if self.bug == "no_offset" else start_pos
        cos, sin = self.cos[first:first + seqlen], self.sin[first:first + seqlen]
        xq, xk = self._rotate(xq, cos, sin), self._rotate(xk, cos, sin)
        self.cache_k[:bsz, start_pos:start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos:start_pos + seqlen] = xv
        if self.bug == "new_first":
            keys = torch.cat([xk, self.cache_k[:bsz, :start_pos]], dim=1)
            values = torch.cat([xv, self.cache_v[:bsz, :start_pos]], dim=1)
        else:
            keys = self.cache_k[:bsz, :start_pos + seqlen]
            values = self.cache_v[:bsz, :start_pos + seqlen]
        rep = self.n_heads // self.n_kv_heads
        keys, values = keys.repeat_interleave(rep, dim=2), values.repeat_interleave(rep, dim=2)
        q, k, v = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
        n_k = k.shape[2]
        if self.bug == "upper_left":
            allowed = torch.ones(seqlen, n_k, dtype=torch.bool).tril()
        else:
            allowed = _allowed(seqlen, n_k)
        scores = scores + torch.zeros(seqlen, n_k).masked_fill(~allowed, float("-inf"))
        out = F.softmax(scores.float(), dim=-1).type_as(q) @ v
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


# --- multi-head latent attention in a decode step ----------------------------------------------------------------


class _RMSNorm(nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class LatentDecode(nn.Module):
    """DeepSeek-V3-like MLA as transformers writes it, no query latent: kv_a_proj_with_mqa -> RMSNorm -> kv_b_proj
    expanding every head's no-RoPE key and value, one rotary key part (half-split) shared by the heads; its cache
    `past_key_value = (keys, values)`, [n_batch, n_head, n_cache, d_K] and [n_batch, n_head, n_cache, d_V], the keys
    whole (no-RoPE part and rotated part), joined on dim 2; the new tokens rotated after the cached ones. Bugs
    `new_first` (cache.order), `is_causal` (SDPA is_causal=True: mask.upper_left), `scale_hidden` (scale.d_model)."""

    def __init__(self, hidden_size=32, num_heads=4, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                 v_head_dim=6, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.nope, self.rope_dim, self.v_dim, self.rank = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = _RMSNorm(kv_lora_rank)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)
        self.scaling = (hidden_size if bug == "scale_hidden" else self.qk_head_dim) ** -0.5

    def _rotate(self, t, start):  # [.., T, d_rope] half-split at positions start ..
        d = t.shape[-1]
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)
        angles = torch.outer(torch.arange(start, start + t.shape[-2]).float(), inv_freq)
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        return t * cos + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin

    def forward(self, hidden_states, past_key_value=None):
        bsz, q_len, _ = hidden_states.shape
        past = 0 if past_key_value is None else past_key_value[0].shape[-2]
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.qk_head_dim).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope_dim], dim=-1)
        compressed_kv, k_pe = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed_kv))
        kv = kv.view(bsz, q_len, self.num_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, value_states = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        q_pe = self._rotate(q_pe, past)
        k_pe = self._rotate(k_pe.view(bsz, 1, q_len, self.rope_dim), past)
        query_states = torch.cat([q_nope, q_pe], dim=-1)
        key_states = torch.cat([k_nope, k_pe.expand(-1, self.num_heads, -1, -1)], dim=-1)
        if past_key_value is not None:
            first = self.bug == "new_first"
            key_states = torch.cat((key_states, past_key_value[0]) if first else (past_key_value[0], key_states), 2)
            value_states = torch.cat((value_states, past_key_value[1]) if first else (past_key_value[1],
                                                                                      value_states), 2)
        if self.bug == "is_causal":
            out = F.scaled_dot_product_attention(query_states, key_states, value_states, is_causal=True,
                                                 scale=self.scaling)
        else:
            scores = query_states @ key_states.transpose(2, 3) * self.scaling
            scores = scores.masked_fill(~_allowed(q_len, key_states.shape[2]), float("-inf"))
            out = scores.softmax(dim=-1) @ value_states
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class LatentHeld(nn.Module):
    """DeepSeek's inference model.py, naive attention: a query latent (wq_a -> RMSNorm -> wq_b), wkv_a -> RMSNorm ->
    wkv_b, the rotary parts turned as complex numbers (interleaved pairs) at start_pos, and its own caches
    `k_cache` [max_batch, max_seq, n_heads, d_K] and `v_cache` [.., d_V] written at start_pos, einsum over
    [b, s, h, d]. Bugs `new_first` (cache.order), `upper_left` (its mask not shifted by start_pos: mask.upper_left),
    `softmax_queries` (softmax.axis)."""

    def __init__(self, dim=32, n_heads=4, q_lora_rank=10, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                 v_head_dim=6, max_batch_size=2, max_seq_len=16, bug=None):
        super().__init__()
        self.n_heads, self.bug = n_heads, bug
        self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim = kv_lora_rank, qk_nope_head_dim, \
            qk_rope_head_dim
        self.qk_head_dim, self.v_head_dim = qk_nope_head_dim + qk_rope_head_dim, v_head_dim
        self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
        self.q_norm = _RMSNorm(q_lora_rank)
        self.wq_b = nn.Linear(q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = _RMSNorm(kv_lora_rank)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        self.softmax_scale = self.qk_head_dim ** -0.5
        self.register_buffer("k_cache", torch.zeros(max_batch_size, max_seq_len, n_heads, self.qk_head_dim),
                             persistent=False)
        self.register_buffer("v_cache", torch.zeros(max_batch_size, max_seq_len, n_heads, v_head_dim),
                             persistent=False)
        freqs = 1.0 / 10000.0 ** (torch.arange(0, qk_rope_head_dim, 2).float() / qk_rope_head_dim)
        angles = torch.outer(torch.arange(4 * max_seq_len).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    @staticmethod
    def _rotate(x, freqs_cis):  # x [b, s, h, d], pairs (0, 1), (2, 3), ...
        turned = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2)) * freqs_cis.view(1, x.size(1), 1, -1)
        return torch.view_as_real(turned).flatten(3).type_as(x)

    def forward(self, x, start_pos=0):
        bsz, seqlen, _ = x.size()
        end_pos = start_pos + seqlen
        freqs_cis = self.freqs_cis[start_pos:end_pos]
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(bsz, seqlen, self.n_heads, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, self._rotate(q_pe, freqs_cis)], dim=-1)
        kv, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = self._rotate(k_pe.unsqueeze(2), freqs_cis)
        kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, self.n_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)
        self.k_cache[:bsz, start_pos:end_pos] = k
        self.v_cache[:bsz, start_pos:end_pos] = v
        if self.bug == "new_first":
            keys = torch.cat([k, self.k_cache[:bsz, :start_pos]], dim=1)
            values = torch.cat([v, self.v_cache[:bsz, :start_pos]], dim=1)
        else:
            keys, values = self.k_cache[:bsz, :end_pos], self.v_cache[:bsz, :end_pos]
        scores = torch.einsum("bshd,bthd->bsht", q, keys) * self.softmax_scale
        shift = 0 if self.bug == "upper_left" else start_pos
        mask = torch.full((seqlen, end_pos), float("-inf")).triu_(1 + shift)
        scores = scores + mask.unsqueeze(1)
        scores = scores.softmax(dim=1 if self.bug == "softmax_queries" else -1, dtype=torch.float32).type_as(x)
        return self.wo(torch.einsum("bsht,bthd->bshd", scores, values).flatten(2))


class CountingKVCache(nn.Module):  # torchtune's: it counts its positions itself, cache_pos moved by add_(seq_len)
    def __init__(self, batch_size, max_seq_len, num_kv_heads, head_dim):
        super().__init__()
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("cache_pos", torch.arange(0, max_seq_len), persistent=False)

    def update(self, k_val, v_val):
        seq_len = k_val.shape[2]
        assert (self.cache_pos[0] + seq_len) <= self.k_cache.shape[2]
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, self.cache_pos[:seq_len]] = k_val
        v_out[:, :, self.cache_pos[:seq_len]] = v_val
        self.cache_pos.add_(seq_len)
        return k_out, v_out


class CountingHeld(nn.Module):
    """torchtune's MultiHeadAttention, shrunk: GQA, a KVCache that counts its own positions (no input_pos), the
    whole cache attended under the mask handed in. Bugs `is_causal` (mask.upper_left), `no_scale` (scale.none)."""

    def __init__(self, embed_dim=32, num_heads=4, num_kv_heads=2, batch_size=2, max_seq_len=16, bug=None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.bug = num_heads, num_kv_heads, embed_dim // num_heads, \
            bug
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.output_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.kv_cache = CountingKVCache(batch_size, max_seq_len, num_kv_heads, self.head_dim)

    def forward(self, x, *, mask=None):
        b, s, _ = x.shape
        q = _heads(self.q_proj(x), self.num_heads)
        k, v = _heads(self.k_proj(x), self.num_kv_heads), _heads(self.v_proj(x), self.num_kv_heads)
        k, v = self.kv_cache.update(k, v)
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.bug == "is_causal":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 if self.bug == "no_scale" else None)
        return self.output_proj(out.transpose(1, 2).reshape(b, s, -1))
