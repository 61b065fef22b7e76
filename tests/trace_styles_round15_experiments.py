"""Attention whose mistakes sit where the reference's order of steps does not put them, in the forms real libraries
write them, for tests/test_trace_round15_experiments.py. Each takes `bug=` for a planted mistake.

Masked before the scale (the code never holds the scaled scores unmasked):
- JStyleAttention: GPT-J's `_attn`: a boolean causal buffer sliced to the decode step's corner, `torch.where(causal,
  q @ kᵀ, finfo.min)`, then `/ scale_attn`, an additive mask after; `layer_past` joined before the attention.
- ScratchCached: LLMs-from-scratch's MultiHeadAttention with its KV cache: a `triu(diagonal=1)` buffer sliced at the
  cached positions, `masked_fill_(mask_bool, -inf)`, then `softmax(attn_scores / keys.shape[-1] ** 0.5)`.
- EinsumBiasFirst: einsum scores with the module's own additive causal bias (-inf above the diagonal) added before
  they are multiplied by the scale, heads `[b, n, h, d]` as T5X-like ports keep them.

Keys and values swapped before RoPE (the rotated keys are the value projection's output):
- LlamaGQA: transformers' LlamaAttention, grouped-query heads, rotate_half.
- PhiPartial: Phi's partial rotary (the first half of each head turned), dense biases.
- MetaComplex: Meta's llama `apply_rotary_emb` through view_as_complex (interleaved pairs), `[b, n, h, d]`.
- QwenNormed: Qwen3's q_norm / k_norm (RMSNorm over d_head) before RoPE, swapped before the norm.

Keys and values swapped in a kernel's arguments, `F.scaled_dot_product_attention(q, v, k)`, with a RoPE of the
processor's own (diffusers' processors):
- GridRopeProcessor: HunyuanDiT-like: a 2-D RoPE over a patch grid (rows on one half of each head, columns on the
  other, half-split pairs), LayerNorm qk-norm. Its `split_no_permute` views the heads without the transpose: the
  code then norms and rotates mis-split heads, so the RoPE the reference needs is read from the code's own tensors.
- TextVideoProcessor: CogVideoX-like: text tokens first, a 3-D (time, row, column) RoPE on the video tokens only
  (interleaved pairs), LayerNorm qk-norm, `query[:, :, n_text:] = rope(...)` in place.
- LuminaLike: a 1-D RoPE through freqs_cis on `[b, n, h, d]`, then sdpa on the heads transposed.

A dropout written by hand, left on in eval():
- HaikuPort: haiku's `hk.dropout` (`keep = bernoulli(keep_rate)`, `keep * x / keep_rate`) on the attention weights,
  its `is_training` left True.
- RandDropout: `mask = torch.rand_like(attn) > p; attn * mask / (1 - p)` with no training guard; `bug=None` guards it
  with `self.training` (so --train draws it).
- FlaxOutputDropout: a flax-like port's broadcast keep-mask (`torch.empty(..).bernoulli_(keep)`) on the heads'
  output before the output kernel, `deterministic` forced False.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def half_split_tables(dim, n, base=10000.0, start=0):
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
    freqs = torch.outer(torch.arange(start, start + n).float(), inv_freq)  # [n, dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


# --- masked before the scale ----------------------------------------------------------------------------------


class JStyleAttention(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, max_positions=32, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        diagonal = 1 if bug == "off_by_one" else 0
        self.register_buffer("bias", torch.tril(torch.ones(max_positions, max_positions, dtype=torch.bool),
                                                diagonal=diagonal).view(1, 1, max_positions, max_positions),
                             persistent=False)
        self.scale_attn = self.head_dim if bug == "scale_d_head" else math.sqrt(self.head_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _split_heads(self, t):
        return t.view(t.shape[:-1] + (self.num_heads, self.head_dim)).permute(0, 2, 1, 3)

    def _attn(self, query, key, value, attention_mask=None):
        q_len, k_len = query.size(-2), key.size(-2)
        if self.bug == "upper_left":
            causal_mask = self.bias[:, :, :q_len, :k_len]
        else:
            causal_mask = self.bias[:, :, k_len - q_len:k_len, :k_len]
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        mask_value = torch.tensor(torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype)
        if self.bug == "polarity":
            attn_weights = torch.where(~causal_mask, attn_weights, mask_value)
        elif self.bug == "fill_zero":
            attn_weights = torch.where(causal_mask, attn_weights, torch.zeros_like(attn_weights))
        else:
            attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        attn_weights = attn_weights / self.scale_attn
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        return torch.matmul(attn_weights, value)

    def forward(self, hidden_states, layer_past=None, attention_mask=None):
        query = self._split_heads(self.q_proj(hidden_states))  # [b, h, n, d]
        key = self._split_heads(self.k_proj(hidden_states))
        value = self._split_heads(self.v_proj(hidden_states))
        if layer_past is not None:
            key = torch.cat((layer_past[0], key), dim=-2)
            value = torch.cat((layer_past[1], value), dim=-2)
        out = self._attn(query, key, value, attention_mask)
        out = out.permute(0, 2, 1, 3).contiguous()
        return self.out_proj(out.view(out.shape[:-2] + (self.num_heads * self.head_dim,)))


class ScratchCached(nn.Module):
    def __init__(self, d_in=32, d_out=32, context_length=32, num_heads=4, qkv_bias=True, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.d_out, self.bug = num_heads, d_out // num_heads, d_out, bug
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        diagonal = 2 if bug == "off_by_one" else 1
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=diagonal),
                             persistent=False)

    def forward(self, x, past_kv=None):
        b, num_tokens, _ = x.shape
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        past = 0
        if past_kv is not None:
            past = past_kv[0].shape[-2]
            keys = torch.cat([past_kv[0], keys], dim=2)
            values = torch.cat([past_kv[1], values], dim=2)
        attn_scores = queries @ keys.transpose(2, 3)  # [b, h, n_Q, n_K]
        n_k = keys.shape[-2]
        if self.bug == "upper_left":
            mask_bool = self.mask.bool()[:num_tokens, :n_k]
        else:
            mask_bool = self.mask.bool()[past:past + num_tokens, :n_k]
        if self.bug == "polarity":
            attn_scores.masked_fill_(~mask_bool, -torch.inf)
        elif self.bug == "fill_zero":
            attn_scores.masked_fill_(mask_bool, 0.0)
        else:
            attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context_vec = (attn_weights @ values).transpose(1, 2)
        return self.out_proj(context_vec.contiguous().view(b, num_tokens, self.d_out))


class EinsumBiasFirst(nn.Module):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.dim_head, self.bug = heads, dim // heads, bug
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, cache=None):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, self.dim_head) for t in (self.to_q(x), self.to_k(x), self.to_v(x)))
        if cache is not None:  # [b, h, n_cache, d], as the reference's cache
            k = torch.cat([cache[0].transpose(1, 2), k], dim=1)
            v = torch.cat([cache[1].transpose(1, 2), v], dim=1)
        m = k.shape[1]
        logits = torch.einsum("bqhd,bkhd->bhqk", q, k)
        i = torch.arange(n)[:, None] + (0 if self.bug == "upper_left" else m - n)
        j = torch.arange(m)[None, :]
        if self.bug == "off_by_one":
            hidden = j >= i  # the diagonal masked as well
        elif self.bug == "polarity":
            hidden = j <= i
        else:
            hidden = j > i
        bias = torch.zeros(n, m).masked_fill(hidden, float("-inf"))
        logits = (logits + bias) * self.dim_head ** -0.5
        weights = logits.softmax(dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", weights, v)
        return self.to_out(out.reshape(b, n, -1))


# --- keys and values swapped before RoPE ------------------------------------------------------------------------


class LlamaGQA(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, num_key_value_heads=2, rope_theta=10000.0, bug=None):
        super().__init__()
        self.num_heads, self.num_kv, self.bug = num_heads, num_key_value_heads, bug
        self.head_dim = hidden_size // num_heads
        self.rope_theta = rope_theta
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def forward(self, hidden_states):
        bsz, q_len, _ = hidden_states.shape
        query_states = self.q_proj(hidden_states)
        if self.bug == "kv_swapped":
            key_states, value_states = self.v_proj(hidden_states), self.k_proj(hidden_states)
        else:
            key_states, value_states = self.k_proj(hidden_states), self.v_proj(hidden_states)
        query_states = query_states.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = half_split_tables(self.head_dim, q_len, self.rope_theta)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin
        groups = self.num_heads // self.num_kv
        key_states = key_states.repeat_interleave(groups, dim=1)
        value_states = value_states.repeat_interleave(groups, dim=1)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        causal = torch.full((q_len, q_len), float("-inf")).triu(1)
        attn_weights = F.softmax(attn_weights + causal, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class PhiPartial(nn.Module):
    def __init__(self, hidden_size=32, num_heads=2, partial_rotary_factor=0.5, rope_theta=10000.0, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.head_dim = hidden_size // num_heads
        self.partial_rotary_factor, self.rope_theta = partial_rotary_factor, rope_theta
        self.rotary_dim = int(partial_rotary_factor * self.head_dim)
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        bsz, q_len, _ = hidden_states.shape
        query_states = self.q_proj(hidden_states)
        key_states = self.v_proj(hidden_states) if self.bug == "kv_swapped" else self.k_proj(hidden_states)
        value_states = self.k_proj(hidden_states) if self.bug == "kv_swapped" else self.v_proj(hidden_states)
        shape = (bsz, q_len, self.num_heads, self.head_dim)
        query_states = query_states.view(shape).transpose(1, 2)
        key_states = key_states.view(shape).transpose(1, 2)
        value_states = value_states.view(shape).transpose(1, 2)
        cos, sin = half_split_tables(self.rotary_dim, q_len, self.rope_theta)
        r = self.rotary_dim
        q_rot, q_pass = query_states[..., :r], query_states[..., r:]
        k_rot, k_pass = key_states[..., :r], key_states[..., r:]
        q_rot = q_rot * cos + rotate_half(q_rot) * sin
        k_rot = k_rot * cos + rotate_half(k_rot) * sin
        query_states = torch.cat((q_rot, q_pass), dim=-1)
        key_states = torch.cat((k_rot, k_pass), dim=-1)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.dense(attn_output)


class MetaComplex(nn.Module):
    def __init__(self, dim=32, n_heads=4, theta=10000.0, max_seq_len=32, bug=None):
        super().__init__()
        self.n_heads, self.head_dim, self.bug = n_heads, dim // n_heads, bug
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        freqs = 1.0 / theta ** (torch.arange(0, self.head_dim, 2)[: self.head_dim // 2].float() / self.head_dim)
        angles = torch.outer(torch.arange(max_seq_len).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, x, mask=None):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x)
        xk, xv = (self.wv(x), self.wk(x)) if self.bug == "kv_swapped" else (self.wk(x), self.wv(x))
        xq = xq.view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_heads, self.head_dim)
        freqs_cis = self.freqs_cis[:seqlen].view(1, seqlen, 1, self.head_dim // 2)
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        xq = torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xv)
        xk = torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xv)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = torch.matmul(xq, xk.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, xv).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class QwenNormed(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, head_dim=8, rope_theta=10000.0, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.rope_theta, self.bug = num_heads, head_dim, rope_theta, bug
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=1e-6)
        self.k_norm = nn.RMSNorm(head_dim, eps=1e-6)

    def forward(self, hidden_states, attention_mask=None):
        bsz, q_len, _ = hidden_states.shape
        hidden_shape = (bsz, q_len, -1, self.head_dim)
        key_proj, value_proj = (self.v_proj, self.k_proj) if self.bug == "kv_swapped" else (self.k_proj, self.v_proj)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(key_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = value_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = half_split_tables(self.head_dim, q_len, self.rope_theta)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.head_dim ** -0.5
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


# --- swapped in a kernel's arguments, beside a processor's own RoPE ---------------------------------------------


def _axis_angles(dim, positions, theta=10000.0):
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    return torch.outer(positions.float(), freqs)  # [n, dim/2]


class GridRopeProcessor(nn.Module):
    def __init__(self, dim=32, heads=2, grid=(2, 3), bug=None):
        super().__init__()
        self.heads, self.head_dim, self.bug = heads, dim // heads, bug
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.norm_q = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.norm_k = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])
        h, w = grid
        rows = torch.arange(h).repeat_interleave(w)
        cols = torch.arange(w).repeat(h)
        quarter = self.head_dim // 2
        angles = torch.cat((_axis_angles(quarter, rows), _axis_angles(quarter, cols)), dim=-1)  # [n, d/2]
        emb = torch.cat((angles, angles), dim=-1)  # half-split pairs
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)

    def split(self, t, batch_size):
        if self.bug == "split_no_permute":
            return t.view(batch_size, self.heads, -1, self.head_dim)
        return t.view(batch_size, -1, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states):
        batch_size, n, _ = hidden_states.shape
        query, key, value = self.to_q(hidden_states), self.to_k(hidden_states), self.to_v(hidden_states)
        query, key, value = (self.split(t, batch_size) for t in (query, key, value))
        query, key = self.norm_q(query), self.norm_k(key)
        query = query * self.rope_cos + rotate_half(query) * self.rope_sin
        key = key * self.rope_cos + rotate_half(key) * self.rope_sin
        if self.bug == "kv_swapped":
            hidden_states = F.scaled_dot_product_attention(query, value, key, dropout_p=0.0, is_causal=False)
        else:
            hidden_states = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, self.heads * self.head_dim)
        return self.to_out[1](self.to_out[0](hidden_states))


class TextVideoProcessor(nn.Module):
    def __init__(self, dim=32, heads=2, n_text=2, frames=2, grid=(2, 2), bug=None):
        super().__init__()
        self.heads, self.head_dim, self.n_text, self.bug = heads, dim // heads, n_text, bug
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.norm_q = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.norm_k = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.to_out = nn.Linear(dim, dim)
        h, w = grid
        t = torch.arange(frames).repeat_interleave(h * w)
        rows = torch.arange(h).repeat_interleave(w).repeat(frames)
        cols = torch.arange(w).repeat(frames * h)
        dim_t = self.head_dim // 4
        dim_hw = (self.head_dim - dim_t) // 2
        angles = torch.cat((_axis_angles(dim_t, t), _axis_angles(dim_hw, rows), _axis_angles(dim_hw, cols)), -1)
        self.register_buffer("freqs_cos", angles.cos().repeat_interleave(2, dim=-1), persistent=False)
        self.register_buffer("freqs_sin", angles.sin().repeat_interleave(2, dim=-1), persistent=False)

    def split(self, t, batch_size):
        if self.bug == "split_no_permute":
            return t.view(batch_size, self.heads, -1, self.head_dim)
        return t.view(batch_size, -1, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, encoder_hidden_states):
        n_text = encoder_hidden_states.size(1)
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        batch_size = x.shape[0]
        query, key, value = self.to_q(x), self.to_k(x), self.to_v(x)
        query, key, value = (self.split(t, batch_size) for t in (query, key, value))
        query, key = self.norm_q(query), self.norm_k(key)
        cos, sin = self.freqs_cos, self.freqs_sin
        query[:, :, n_text:] = query[:, :, n_text:] * cos + rotate_every_two(query[:, :, n_text:]) * sin
        key[:, :, n_text:] = key[:, :, n_text:] * cos + rotate_every_two(key[:, :, n_text:]) * sin
        if self.bug == "kv_swapped":
            out = F.scaled_dot_product_attention(query, value, key)
        else:
            out = F.scaled_dot_product_attention(query, key, value)
        out = self.to_out(out.transpose(1, 2).reshape(batch_size, -1, self.heads * self.head_dim))
        encoder_out, video_out = out.split([n_text, out.size(1) - n_text], dim=1)
        return video_out, encoder_out


class LuminaLike(nn.Module):
    def __init__(self, dim=32, n_heads=4, theta=10000.0, bug=None):
        super().__init__()
        self.n_heads, self.head_dim, self.theta, self.bug = n_heads, dim // n_heads, theta, bug
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        q, k, v = (t(hidden_states).view(b, n, self.n_heads, self.head_dim) for t in (self.to_q, self.to_k, self.to_v))
        angles = _axis_angles(self.head_dim, torch.arange(n), self.theta)
        freqs_cis = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]  # [1, n, 1, d/2]
        q = torch.view_as_real(torch.view_as_complex(q.reshape(b, n, self.n_heads, -1, 2)) * freqs_cis).flatten(3)
        k = torch.view_as_real(torch.view_as_complex(k.reshape(b, n, self.n_heads, -1, 2)) * freqs_cis).flatten(3)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.bug == "kv_swapped":
            out = F.scaled_dot_product_attention(q, v, k, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


# --- a dropout written by hand ----------------------------------------------------------------------------------


def haiku_dropout(rate, x, generator=None):
    keep_rate = 1.0 - rate
    keep = torch.bernoulli(torch.full(x.shape, keep_rate, dtype=x.dtype), generator=generator)
    return keep * x / keep_rate


class HaikuPort(nn.Module):
    def __init__(self, model_size=32, num_heads=4, key_size=8, dropout_rate=0.2, bug=None):
        super().__init__()
        self.num_heads, self.key_size, self.dropout_rate, self.bug = num_heads, key_size, dropout_rate, bug
        self.query = nn.Linear(model_size, num_heads * key_size)
        self.key = nn.Linear(model_size, num_heads * key_size)
        self.value = nn.Linear(model_size, num_heads * key_size)
        self.linear = nn.Linear(num_heads * key_size, model_size)
        self.is_training = bug == "dropout_on"  # left True at inference

    def forward(self, query, key=None, value=None, mask=None):
        key = query if key is None else key
        value = key if value is None else value
        *lead, t, _ = query.shape
        q = self.query(query).reshape(*lead, t, self.num_heads, self.key_size)
        k = self.key(key).reshape(*lead, key.shape[-2], self.num_heads, self.key_size)
        v = self.value(value).reshape(*lead, value.shape[-2], self.num_heads, self.key_size)
        attn_logits = torch.einsum("...thd,...Thd->...htT", q, k) / math.sqrt(self.key_size)
        if mask is not None:
            attn_logits = torch.where(mask, attn_logits, -1e30)
        attn_weights = torch.softmax(attn_logits, dim=-1)
        if self.is_training:
            attn_weights = haiku_dropout(self.dropout_rate, attn_weights, torch.Generator().manual_seed(1))
        attn = torch.einsum("...htT,...Thd->...thd", attn_weights, v)
        return self.linear(attn.reshape(*lead, t, -1))


class RandDropout(nn.Module):
    def __init__(self, dim=32, heads=4, p=0.25, bug=None):
        super().__init__()
        self.heads, self.p, self.bug = heads, p, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * (C // self.heads) ** -0.5
        attn = attn.softmax(dim=-1)
        if self.bug == "dropout_on" or self.training:
            g = torch.Generator().manual_seed(2)
            keep = (torch.rand(attn.shape, generator=g, dtype=attn.dtype) > self.p).to(attn.dtype)
            attn = attn * keep / (1 - self.p)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class FlaxOutputDropout(nn.Module):
    def __init__(self, features=32, num_heads=4, dropout_rate=0.1, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.dropout_rate, self.bug = num_heads, features // num_heads, dropout_rate, bug
        g = torch.Generator().manual_seed(5)
        self.query_kernel = nn.Parameter(torch.randn(features, num_heads, self.head_dim, generator=g) * 0.3)
        self.key_kernel = nn.Parameter(torch.randn(features, num_heads, self.head_dim, generator=g) * 0.3)
        self.value_kernel = nn.Parameter(torch.randn(features, num_heads, self.head_dim, generator=g) * 0.3)
        self.out_kernel = nn.Parameter(torch.randn(num_heads, self.head_dim, features, generator=g) * 0.3)

    def forward(self, inputs_q, deterministic=True):
        if self.bug == "dropout_on":
            deterministic = False
        q = torch.einsum("bnf,fhd->bnhd", inputs_q, self.query_kernel) / math.sqrt(self.head_dim)
        k = torch.einsum("bnf,fhd->bnhd", inputs_q, self.key_kernel)
        v = torch.einsum("bnf,fhd->bnhd", inputs_q, self.value_kernel)
        weights = torch.einsum("bqhd,bkhd->bhqk", q, k).softmax(dim=-1)
        x = torch.einsum("bhqk,bkhd->bqhd", weights, v)
        if not deterministic:
            keep_prob = 1.0 - self.dropout_rate
            keep = torch.empty((1, x.shape[1], 1, x.shape[3]), dtype=x.dtype).bernoulli_(
                keep_prob, generator=torch.Generator().manual_seed(3))
            x = torch.where(keep.bool(), x / keep_prob, torch.zeros_like(x))
        return torch.einsum("bqhd,hdf->bqf", x, self.out_kernel)
