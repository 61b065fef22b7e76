"""Round 15's masks, in styles of our own: a module's own mask applied after the softmax (a causal buffer, a tril
made at run time), an additive mask added to the weights after it, a band on both sides merged into the causal mask
the module is given, and a module that refuses trace's mask (its own causal rule) or takes query, key and value
but runs only on one tensor. Each class takes `bug=` to plant one mistake; None is the correct code."""

import math

import torch
import torch.nn.functional as F
from torch import nn


def split(t, h):
    return t.unflatten(-1, (h, -1)).transpose(1, 2)  # [B, n, h·d] -> [B, h, n, d]


def merge(t):
    return t.transpose(1, 2).flatten(2)  # [B, h, n, d] -> [B, n, h·d]


# --- a mask of the module's own applied after the softmax ------------------------------------------------------


class Gpt2Causal(nn.Module):
    """GPT-2's (transformers) attention: a fused c_attn, a causal bool buffer `bias` applied with torch.where and
    finfo.min, the additive attention_mask after it. bug "after_softmax": the buffer applied to the weights."""

    def __init__(self, d=32, h=4, max_positions=16, bug=None):
        super().__init__()
        self.h, self.bug = h, bug
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.register_buffer("bias", torch.tril(torch.ones(max_positions, max_positions, dtype=torch.bool))
                             .view(1, 1, max_positions, max_positions), persistent=False)

    def forward(self, hidden_states, attention_mask=None):
        q, k, v = (split(t, self.h) for t in self.c_attn(hidden_states).split(hidden_states.shape[-1], dim=2))
        w = q @ k.transpose(-1, -2) / math.sqrt(v.shape[-1])
        n_Q, n_K = q.shape[-2], k.shape[-2]
        causal = self.bias[:, :, n_K - n_Q:n_K, :n_K]
        if self.bug != "after_softmax":
            w = torch.where(causal, w, torch.finfo(w.dtype).min)
        if attention_mask is not None:
            w = w + attention_mask
        w = F.softmax(w, dim=-1)
        if self.bug == "after_softmax":
            w = torch.where(causal, w, torch.zeros_like(w))
        return self.c_proj(merge(w @ v))


class MinGptBuffer(nn.Module):
    """minGPT's CausalSelfAttention with separate key, query, value: a float tril buffer `mask` filled with -inf
    where it is 0, and a boolean attn_mask (True = may attend) beside it. bug "after_softmax": the weights multiplied
    by the buffer after the softmax (and its attention dropout)."""

    def __init__(self, n_embd=32, n_head=4, block_size=16, bug=None):
        super().__init__()
        self.n_head, self.bug = n_head, bug
        self.key, self.query, self.value = (nn.Linear(n_embd, n_embd) for _ in range(3))
        self.proj = nn.Linear(n_embd, n_embd)
        self.attn_drop = nn.Dropout(0.1)
        self.register_buffer("mask", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x, attn_mask=None):
        T = x.shape[1]
        k, q, v = split(self.key(x), self.n_head), split(self.query(x), self.n_head), split(self.value(x), self.n_head)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        if self.bug != "after_softmax":
            att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        if attn_mask is not None:
            att = att.masked_fill(~attn_mask, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        if self.bug == "after_softmax":  # after the dropout, a no-op in eval()
            att = att * self.mask[:, :, :T, :T]
        return self.proj(merge(att @ v))


class TrilEinsum(nn.Module):
    """An x-transformers-like Attend: einsum, the causal mask made at run time (`ones(i, j).triu(j - i + 1)`, True =
    masked) beside a boolean `mask` (True = may attend). bug "after_softmax": the weights at the causal mask's
    cells filled with 0 after the softmax."""

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        q, k, v = (split(t, self.heads) for t in self.to_qkv(x).chunk(3, dim=-1))
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
        i, j = sim.shape[-2:]
        causal = torch.ones((i, j), dtype=torch.bool).triu(j - i + 1)
        if self.bug != "after_softmax":
            sim = sim.masked_fill(causal, -torch.finfo(sim.dtype).max)
        if mask is not None:
            sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        if self.bug == "after_softmax":
            attn = attn.masked_fill(causal, 0.0)
        return self.to_out(merge(torch.einsum("bhij,bhjd->bhid", attn, v)))


# --- an additive mask added to the weights after the softmax ---------------------------------------------------


class BertLikeSelf(nn.Module):
    """transformers' BertSelfAttention-like: no output projection, the 4-D additive attention_mask added to the
    scores. bug "added_after": added to the probabilities after the softmax (ESM's plant)."""

    def __init__(self, hidden_size=32, num_attention_heads=4, bug=None):
        super().__init__()
        self.h, self.bug = num_attention_heads, bug
        self.query, self.key, self.value = (nn.Linear(hidden_size, hidden_size) for _ in range(3))

    def forward(self, hidden_states, attention_mask=None):
        q, k, v = (split(f(hidden_states), self.h) for f in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if attention_mask is not None and self.bug != "added_after":
            scores = scores + attention_mask
        probs = F.softmax(scores, dim=-1)
        if attention_mask is not None and self.bug == "added_after":
            probs = probs + attention_mask
        return (merge(probs @ v),)


class BiasAdded(nn.Module):
    """xformers-like, the heads' merge returned (no output projection: a block's own follows): an `attn_bias`
    (additive, defaulting to None) added to the scores. bug "added_after": the bias added to the weights after the
    softmax."""

    def __init__(self, dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))

    def forward(self, x, attn_bias=None):
        q, k, v = (split(f(x), self.num_heads) for f in (self.wq, self.wk, self.wv))
        attn = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        if attn_bias is not None and self.bug != "added_after":
            attn = attn + attn_bias
        attn = attn.softmax(dim=-1)
        if attn_bias is not None and self.bug == "added_after":
            attn = attn + attn_bias
        return merge(attn @ v)


class BaddbmmAdded(nn.Module):
    """A diffusers-like processor, its output projection left to the caller: heads folded into the batch,
    `torch.baddbmm(attention_mask, q, kᵀ, beta=1, alpha=scale)` with the additive mask [n_batch, 1, n_K] repeated
    over the heads. bug "added_after": the scores made without it (beta=0) and the mask added to the
    probabilities."""

    def __init__(self, query_dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_q, self.to_k, self.to_v = (nn.Linear(query_dim, query_dim, bias=False) for _ in range(3))

    def fold(self, t):
        b, n, _ = t.shape
        return split(t, self.heads).reshape(b * self.heads, n, -1)  # [B, n, h·d] -> [B·h, n, d]

    def forward(self, hidden_states, attention_mask=None):
        b, n, _ = hidden_states.shape
        q, k, v = (self.fold(f(hidden_states)) for f in (self.to_q, self.to_k, self.to_v))
        bias = torch.zeros(b * self.heads, 1, n, dtype=q.dtype)
        if attention_mask is not None:  # [B, 1, n_K] -> [B·h, 1, n_K]
            bias = attention_mask.repeat_interleave(self.heads, dim=0)
        scale = q.shape[-1] ** -0.5
        if self.bug == "added_after":
            probs = torch.baddbmm(bias, q, k.transpose(-1, -2), beta=0, alpha=scale).softmax(dim=-1) + bias
        else:
            probs = torch.baddbmm(bias, q, k.transpose(-1, -2), beta=1, alpha=scale).softmax(dim=-1)
        out = torch.bmm(probs, v).reshape(b, self.heads, n, -1)  # [B·h, n, d] -> [B, h, n, d]
        return merge(out)


# --- a band on both sides, merged into the causal mask the module is given ------------------------------------


class GemmaBand(nn.Module):
    """gemma_pytorch's local layer: `triu(ones_like(mask), -W + 1) * tril(ones_like(mask), W - 1)` merged into the
    additive mask it is given (the causal one, from its caller). bug "window": the band one key wider on the left."""

    def __init__(self, hidden_size=32, num_heads=4, sliding_window_size=4, bug=None):
        super().__init__()
        self.num_heads, self.window, self.bug = num_heads, sliding_window_size, bug
        self.qkv_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, mask):
        q, k, v = (split(t, self.num_heads) for t in self.qkv_proj(hidden_states).split(hidden_states.shape[-1], -1))
        scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(2, 3))
        all_ones = torch.ones_like(mask)
        lower = -self.window if self.bug == "window" else -self.window + 1
        sliding = torch.triu(all_ones, lower) * torch.tril(all_ones, self.window - 1)
        mask = torch.where(sliding == 1, mask, -2.3819763e38)
        probs = F.softmax((scores + mask).float(), dim=-1).type_as(q)
        return self.o_proj(merge(torch.matmul(probs, v)))


class BoolBand(nn.Module):
    """A boolean band |i - j| < W anded with the boolean attn_mask it is given (True = may attend), then
    masked_fill(~allowed, -inf). bug "window": |i - j| <= W, one key wider."""

    def __init__(self, dim=32, heads=4, window=4, bug=None):
        super().__init__()
        self.heads, self.window, self.bug = heads, window, bug
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.o = nn.Linear(dim, dim)

    def forward(self, x, attn_mask):
        q, k, v = split(self.q(x), self.heads), split(self.k(x), self.heads), split(self.v(x), self.heads)
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        i = torch.arange(x.shape[1])
        distance = (i[:, None] - i[None, :]).abs()
        band = distance <= self.window if self.bug == "window" else distance < self.window
        scores = scores.masked_fill(~(attn_mask & band), float("-inf"))
        return self.o(merge(scores.softmax(-1) @ v))


class HfBand(nn.Module):
    """transformers-like: the band made as `full((n, n), True).triu(-W + 1).tril(W - 1)` and merged into the 4-D
    additive attention_mask by masked_fill(~band, finfo.min), then SDPA with attn_mask. bug "window": triu(-W)."""

    def __init__(self, hidden_size=32, num_attention_heads=4, sliding_window=4, bug=None):
        super().__init__()
        self.h, self.sliding_window, self.bug = num_attention_heads, sliding_window, bug
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden_size, hidden_size) for _ in range(3))
        self.o_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask):
        q, k, v = (split(f(hidden_states), self.h) for f in (self.q_proj, self.k_proj, self.v_proj))
        n = hidden_states.shape[1]
        low = -self.sliding_window if self.bug == "window" else -self.sliding_window + 1
        band = torch.full((n, n), True).triu(low).tril(self.sliding_window - 1)
        attention_mask = attention_mask.masked_fill(~band, torch.finfo(q.dtype).min)
        return self.o_proj(merge(F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)))


# --- a module that refuses trace's mask, or runs only on one tensor --------------------------------------------


class StreamingLike(nn.Module):
    """AudioCraft-like: forward(query, key, value, key_padding_mask=None, attn_mask=None); with its own causal=True it
    asserts attn_mask is None and builds a causal bias itself; its self-attention asserts query is key. bug
    "off_by_one": one later key let through."""

    def __init__(self, embed_dim=32, num_heads=4, causal=True, bug=None):
        super().__init__()
        self.num_heads, self.causal, self.bug = num_heads, causal, bug
        in_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.in_proj_weight, self.in_proj_bias = in_proj.weight, in_proj.bias
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, key_padding_mask=None, attn_mask=None):
        if self.causal:
            assert attn_mask is None
            n = query.shape[1]
            delta = torch.arange(n)[:, None] - torch.arange(n)[None, :]
            valid = delta >= (-1 if self.bug == "off_by_one" else 0)
            attn_mask = torch.where(valid, torch.zeros([]), torch.full([], float("-inf"))).to(query.dtype)
        assert key_padding_mask is None
        assert query is key, "specialized implementation"
        assert value is key, "specialized implementation"
        projected = F.linear(query, self.in_proj_weight, self.in_proj_bias)
        q, k, v = projected.unflatten(-1, (3, self.num_heads, -1)).unbind(dim=2)  # each [B, n, h, d]
        pre_w = torch.einsum("bthd,bkhd->bhtk", q / q.shape[-1] ** 0.5, k)
        if attn_mask is not None:
            pre_w = pre_w + attn_mask
        x = torch.einsum("bhtk,bkhd->bthd", torch.softmax(pre_w, dim=-1), v)
        return self.out_proj(x.flatten(2)), None


class RefusesMask(nn.Module):
    """A module whose causal rule is its own: a mask it is given is refused with a ValueError, and SDPA runs with
    is_causal=True. bug "scale_d_head": SDPA's scale 1 / d_head."""

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, mask=None):
        if mask is not None:
            raise ValueError("this attention is causal by itself: pass no mask")
        q, k, v = (split(t, self.heads) for t in self.wqkv(x).chunk(3, -1))
        scale = 1 / q.shape[-1] if self.bug == "scale_d_head" else None
        return self.wo(merge(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)))


class SelfOnly(nn.Module):
    """fairseq-like self_attention: forward(query, key, value, attn_mask=None) that checks `query is key is value`,
    a tril buffer of its own beside the additive attn_mask it takes. bug "kv_swapped": k and v swapped."""

    def __init__(self, embed_dim=32, num_heads=4, max_len=16, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(3))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.register_buffer("future", torch.ones(max_len, max_len).tril() == 0)

    def forward(self, query, key, value, attn_mask=None):
        if not (query is key and key is value):
            raise ValueError("self-attention only: query, key and value must be the same tensor")
        q, k, v = (split(f(query), self.num_heads) for f in (self.q_proj, self.k_proj, self.v_proj))
        if self.bug == "kv_swapped":
            k, v = v, k
        w = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        n = query.shape[1]
        w = w.masked_fill(self.future[:n, :n], float("-inf"))
        if attn_mask is not None:
            w = w + attn_mask
        return self.out_proj(merge(w.softmax(-1) @ v))
