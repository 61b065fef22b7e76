"""Eight more attention code styles for `attnscope trace` (issue 41), none of them in docs/examples/code_styles.py:
grouped-query attention as a 5-D matmul without a repeat (q viewed [B, n_kv_head, n_group, T, d_head]), a rotary
module whose base is its config's `rope_theta` handed to a `RotaryEmbedding`, a decode step that joins a KV cache,
diffusers-style heads folded into the batch with a `[B, 1, n_K]` additive padding mask added by `baddbmm`, RoPE
frequencies kept as a buffer of the model's own base, x-transformers' weightless `Attend` with a `[b, n]` key-padding
mask and a causal mask aligned lower-right, flash-attn's MHA with a `[B, S]` key padding, lit-llama's SDPA dropout.

Each class is correct as written (`bug=""`); `bug="..."` plants one mistake the way people make it, for
tests/test_trace_more_styles.py to check that trace names it. The comments say which.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class GroupedMatmul(nn.Module):
    """GQA with no repeat_kv: q [B, n_kv, n_group, T, d], k and v unsqueezed to [B, n_kv, 1, S, d].
    Bugs: "noscale" (no 1/√d_head), "tril1" (causal band one key wide), "axis" (softmax over the queries),
    "v_is_k" (values taken from the keys), "group_order" (q's heads grouped n_group outer: head h reads h % n_kv)."""

    def __init__(self, dim=48, n_heads=6, n_kv_heads=2, bug=""):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.bug = n_heads, n_kv_heads, bug
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        g = self.n_heads // self.n_kv_heads
        if self.bug == "group_order":  # query head h = i·n_kv + j read as group i of key/value head j
            q = self.wq(x).view(B, T, g, self.n_kv_heads, self.head_dim).permute(0, 3, 2, 1, 4)
        else:
            q = self.wq(x).view(B, T, self.n_kv_heads, g, self.head_dim).permute(0, 2, 3, 1, 4)  # [B, kv, g, T, d]
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2).unsqueeze(2)  # [B, kv, 1, T, d]
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2).unsqueeze(2)
        scores = q @ k.transpose(-2, -1)  # [B, kv, g, T, T]
        if self.bug != "noscale":
            scores = scores / math.sqrt(self.head_dim)
        causal = torch.ones(T, T, dtype=torch.bool).tril(1 if self.bug == "tril1" else 0)
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = scores.softmax(dim=-2 if self.bug == "axis" else -1)
        out = attn @ (k if self.bug == "v_is_k" else v)  # [B, kv, g, T, d]
        order = (0, 3, 2, 1, 4) if self.bug == "group_order" else (0, 3, 1, 2, 4)  # heads back in wq's order
        return self.wo(out.permute(order).reshape(B, T, -1))


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.base = base
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, positions):
        freqs = torch.outer(positions.float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class RopeConfig:
    def __init__(self, hidden_size=48, num_attention_heads=3, rope_theta=500000.0):
        self.hidden_size, self.num_attention_heads, self.rope_theta = hidden_size, num_attention_heads, rope_theta


class ThetaAttention(nn.Module):
    """A config's rope_theta (500000, Llama 3's) handed to the rotary module: its own base, not the default.
    Bugs: "forgot_base" (RotaryEmbedding built without the config's base: 10000), "scale_d_model" (/ √d_model),
    "rope_on_v" (the values rotated too)."""

    def __init__(self, config=None, bug=""):
        super().__init__()
        self.config = config = config or RopeConfig()
        self.bug = bug
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        dim = config.hidden_size
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(dim, dim, bias=False)
        base = 10000.0 if bug == "forgot_base" else config.rope_theta
        self.rotary_emb = RotaryEmbedding(self.head_dim, base=base)

    def forward(self, hidden_states):
        B, T, C = hidden_states.shape
        q, k, v = (p(hidden_states).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = self.rotary_emb(torch.arange(T))
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.bug == "rope_on_v":
            v = v * cos + rotate_half(v) * sin
        width = C if self.bug == "scale_d_model" else self.head_dim
        scores = q @ k.transpose(-1, -2) / math.sqrt(width)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class CachedDecode(nn.Module):
    """A decode step: the new keys and values joined after the cached ones, a lower-right causal mask.
    Bugs: "cache_order" (new keys before the cached ones), "upper_left" (is_causal=True on n_Q < n_K),
    "kv_swapped" (keys and values swapped)."""

    def __init__(self, d_model=40, n_head=5, bug=""):
        super().__init__()
        self.n_head, self.bug = n_head, bug
        self.d_head = d_model // n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x, past_key_value=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, self.d_head).transpose(1, 2) for t in (q, k, v))
        if past_key_value is not None:
            k_cache, v_cache = past_key_value
            if self.bug == "cache_order":
                k, v = torch.cat([k, k_cache], dim=-2), torch.cat([v, v_cache], dim=-2)
            else:
                k, v = torch.cat([k_cache, k], dim=-2), torch.cat([v_cache, v], dim=-2)
        if self.bug == "kv_swapped":
            k, v = v, k
        S = k.shape[-2]
        if self.bug == "upper_left":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class PaddedBaddbmm(nn.Module):
    """Heads folded into the batch, an additive key-padding mask [B, 1, n_K] added by baddbmm (diffusers' way).
    Bugs: "on_queries" (the mask transposed to [B, n_K, 1]: query rows masked), "merge" (heads merged by a view
    without moving them behind the tokens first), "noscale" (alpha=1)."""

    def __init__(self, dim=32, heads=4, bug=""):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)

    def fold(self, t):
        B, S, C = t.shape
        return t.view(B, S, self.heads, C // self.heads).transpose(1, 2).reshape(B * self.heads, S, C // self.heads)

    def forward(self, hidden_states, attention_mask=None):
        B, S, C = hidden_states.shape
        q, k, v = (self.fold(p(hidden_states)) for p in (self.to_q, self.to_k, self.to_v))
        bias = torch.zeros(B * self.heads, 1, S)
        if attention_mask is not None:  # [B, 1, S], 0 = keep, -inf = padded
            if attention_mask.dtype == torch.bool:
                attention_mask = torch.zeros(attention_mask.shape).masked_fill(~attention_mask, float("-inf"))
            if self.bug == "on_queries":
                attention_mask = attention_mask.transpose(-1, -2)
            bias = attention_mask.repeat_interleave(self.heads, dim=0)
        alpha = 1.0 if self.bug == "noscale" else (C // self.heads) ** -0.5
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), beta=1, alpha=alpha)
        out = torch.bmm(scores.softmax(dim=-1), v)
        if self.bug == "merge":
            out = out.reshape(B, S, C)
        else:
            out = out.view(B, self.heads, S, -1).transpose(1, 2).reshape(B, S, C)
        return self.to_out(out)


class FixedTheta(nn.Module):
    """RoPE frequencies made once with base 1e6 (a long-context model's own choice) and kept as a buffer, with no
    base or rope_theta said anywhere else: trace reads the base from that inv_freq buffer, the module's own."""

    def __init__(self, dim=48, heads=3):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("inv_freq", 1.0 / 1e6 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)  # [B, H, T, d] each
        freqs = torch.outer(torch.arange(T).float(), self.inv_freq)
        cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Attend(nn.Module):
    """x-transformers' Attend, no weights: q, k, v [b, h, n, d], a key-padding mask [b, n] (True = keep), a causal
    mask aligned to the last key (lower-right) where there are more keys than queries, masked with -finfo.max.
    Bugs: "on_queries" (the padding mask on the query rows), "scale_twice" (the scale applied again)."""

    def __init__(self, causal=False, bug=""):
        super().__init__()
        self.causal, self.bug = causal, bug

    def forward(self, q, k, v, mask=None):
        scale = q.shape[-1] ** -0.5
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * scale
        if self.bug == "scale_twice":
            sim = sim * scale
        if mask is not None:
            keep = mask[:, None, :, None] if self.bug == "on_queries" else mask[:, None, None, :]
            sim = sim.masked_fill(~keep, -torch.finfo(sim.dtype).max)
        if self.causal:
            i, j = sim.shape[-2:]
            sim = sim.masked_fill(torch.ones(i, j, dtype=torch.bool).triu(j - i + 1), -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        return torch.einsum("b h i j, b h j d -> b h i d", attn, v)


class FlashPadded(nn.Module):
    """flash-attn's MHA with its own causal mask and a key_padding_mask [B, S] (True = keep): Wqkv packed
    [b, s, 3, h, d]. Run with only --causal, trace pads a key itself so that the mask's axis shows.
    Bugs: "on_queries" (the padding mask on the query rows)."""

    def __init__(self, embed_dim=32, num_heads=4, bug=""):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.head_dim = embed_dim // num_heads
        self.Wqkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, key_padding_mask=None):
        B, S, _ = x.shape
        q, k, v = self.Wqkv(x).view(B, S, 3, self.num_heads, self.head_dim).unbind(dim=2)  # [b, s, h, d] each
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(self.head_dim)  # [b, h, t, s]
        if key_padding_mask is not None:
            keep = key_padding_mask[:, None, :, None] if self.bug == "on_queries" else key_padding_mask[:, None, None]
            scores = scores.masked_fill(~keep, float("-inf"))
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("bhts,bshd->bthd", scores.softmax(dim=-1), v).reshape(B, S, -1)
        return self.out_proj(out)


class LitDropout(nn.Module):
    """lit-llama's causal self-attention with attention dropout: SDPA's dropout_p on in training mode only.
    Bugs: "no_guard" (dropout_p=self.dropout, no `if self.training`: it drops in eval() mode too)."""

    def __init__(self, n_embd=32, n_head=4, dropout=0.1, bug=""):
        super().__init__()
        self.n_head, self.n_embd, self.dropout, self.bug = n_head, n_embd, dropout, bug
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.bug == "no_guard" or self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=p, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
