"""Styles whose words say how they read their boolean mask, written in forms of our own: a tutorial's multi-head
module with a scaled-dot-product helper and a comment on its masking line; a core on split heads with a module-level
mask function, its docstring saying `True = masked`; a key-padding cross-attention that folds its heads into the
batch, its docstring saying the padded keys are filled where the mask is False; and a `torch.where` module whose
forward's docstring gives the HF-like "1 for tokens to attend, 0 for padding"; and functions on heads-last inputs
whose words are those of the helper they call, which takes the same mask (flax's; the flipped one, which hands the
helper its mask turned round, says so in its own words: the helper's words alone are said of what it is handed).
Each comes right and with its mask read the other way round (`mask.polarity`); one more reads its mask as its words
say but scales twice."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class ScaledDotProduct(nn.Module):
    def __init__(self, temperature):
        super().__init__()
        self.temperature = temperature

    def forward(self, q, k, v, mask=None):
        scores = q @ k.transpose(-2, -1) / self.temperature
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)  # the mask is True where a key may be attended
        return torch.softmax(scores, dim=-1) @ v


class FlippedDotProduct(ScaledDotProduct):
    def forward(self, q, k, v, mask=None):
        scores = q @ k.transpose(-2, -1) / self.temperature
        if mask is not None:
            scores = scores.masked_fill(mask, -1e9)  # the mask is True where a key may be attended
        return torch.softmax(scores, dim=-1) @ v


class TutorialMHA(nn.Module):
    """Multi-head attention as a tutorial writes it: project, split the heads, the helper, merge, project."""

    inner = ScaledDotProduct

    def __init__(self, d_model=24, n_head=3):
        super().__init__()
        self.n_head, self.d_head = n_head, d_model // n_head
        self.w_q, self.w_k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.w_v, self.w_o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.attend = self.inner(self.d_head ** 0.5)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        q, k, v = (w(x).view(b, n, self.n_head, self.d_head).transpose(1, 2) for w in (self.w_q, self.w_k, self.w_v))
        if mask is not None:
            mask = mask.unsqueeze(1)  # the same mask for every head
        out = self.attend(q, k, v, mask)
        return self.w_o(out.transpose(1, 2).reshape(b, n, -1))


class TutorialFlipped(TutorialMHA):
    inner = FlippedDotProduct


def mask_fill(scores, attention_mask):
    scores.masked_fill_(attention_mask, -10000.0)
    return scores


def mask_fill_flipped(scores, attention_mask):
    scores.masked_fill_(~attention_mask, -10000.0)
    return scores


class SplitCore(nn.Module):
    """A core attention on heads already split, q, k, v [b, h, n, d]; the attention mask [b, 1, n_Q, n_K] is
    boolean, True = masked (filled with -10000 before the softmax)."""

    fill = staticmethod(mask_fill)
    twice = False

    def forward(self, query, key, value, attention_mask):
        d = query.shape[-1]
        scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d)
        if self.twice:
            scores = scores / math.sqrt(d)
        probs = torch.softmax(self.fill(scores, attention_mask), dim=-1)
        return torch.matmul(probs, value)


class SplitFlipped(SplitCore):
    fill = staticmethod(mask_fill_flipped)


class SplitTwice(SplitCore):
    twice = True


class FoldedCross(nn.Module):
    """Cross-attention with its heads folded into the batch; a key mask [b, n_K], its padded keys filled with
    -finfo.max where the mask is False."""

    flipped = False

    def __init__(self, query_dim=24, context_dim=16, heads=3, dim_head=8):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.scale = heads, dim_head ** -0.5
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(context_dim, inner, bias=False)
        self.to_v = nn.Linear(context_dim, inner, bias=False)
        self.to_out = nn.Linear(inner, query_dim)

    def forward(self, x, context, mask=None):
        h = self.heads
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        q, k, v = (t.reshape(t.shape[0], t.shape[1], h, -1).permute(0, 2, 1, 3).reshape(t.shape[0] * h, t.shape[1], -1)
                   for t in (q, k, v))
        sim = torch.einsum("bid,bjd->bij", q, k) * self.scale
        if mask is not None:
            mask = mask.repeat_interleave(h, dim=0)[:, None, :]
            sim = sim.masked_fill(mask if self.flipped else ~mask, -torch.finfo(sim.dtype).max)
        out = torch.einsum("bij,bjd->bid", sim.softmax(dim=-1), v)
        b = out.shape[0] // h
        return self.to_out(out.reshape(b, h, out.shape[1], -1).permute(0, 2, 1, 3).reshape(b, out.shape[1], -1))


class FoldedFlipped(FoldedCross):
    flipped = True


class WhereMHA(nn.Module):
    def __init__(self, hidden=24, heads=3):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def weights(self, scores, attention_mask):
        return torch.where(attention_mask[:, None, None, :], scores, torch.finfo(scores.dtype).min)

    def forward(self, hidden_states, attention_mask=None):
        """attention_mask: [batch, seq] of 1 for tokens to attend and 0 for padding."""
        b, n, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) * self.head_dim ** -0.5
        if attention_mask is not None:
            scores = self.weights(scores, attention_mask.bool())
        out = F.softmax(scores, dim=-1) @ v
        return self.out(out.transpose(1, 2).reshape(b, n, -1))


class WhereFlipped(WhereMHA):
    def weights(self, scores, attention_mask):
        return torch.where(attention_mask[:, None, None, :], torch.finfo(scores.dtype).min, scores)


def attention_weights(query, key, mask=None):
    """Weights of the keys for each query, query and key [batch, length, heads, depth].

    mask: boolean, broadcastable to [batch, heads, q_length, kv_length]; False means the weight is masked out.
    """
    weights = torch.einsum("bqhd,bkhd->bhqk", query / query.shape[-1] ** 0.5, key)
    if mask is not None:
        weights = torch.where(mask, weights, torch.finfo(weights.dtype).min)
    return torch.softmax(weights, dim=-1)


def heads_last_attention(query, key, value, mask=None):
    return torch.einsum("bhqk,bkhd->bqhd", attention_weights(query, key, mask), value)


def heads_last_flipped(query, key, value, mask=None):
    """Attention of query, key and value [batch, length, heads, depth]; mask as attention_weights takes it: False
    means the weight is masked out."""
    weights = attention_weights(query, key, None if mask is None else ~mask)
    return torch.einsum("bhqk,bkhd->bqhd", weights, value)


# --- words that say which value a large negative number is written at ---------------------------------------------


class StaticBlock(nn.Module):
    """A block with its attention a static method, as Umar Jamil's transformer writes it; `flipped` masks where the
    mask is 1, against the comment on the line."""

    flipped = False

    def __init__(self, d_model=24, h=3):
        super().__init__()
        self.h, self.d_k = h, d_model // h
        self.w_q, self.w_k = nn.Linear(d_model, d_model, bias=False), nn.Linear(d_model, d_model, bias=False)
        self.w_v, self.w_o = nn.Linear(d_model, d_model, bias=False), nn.Linear(d_model, d_model, bias=False)

    @staticmethod
    def attention(query, key, value, mask, flipped):
        d_k = query.shape[-1]
        attention_scores = (query @ key.transpose(-2, -1)) / math.sqrt(d_k)
        if mask is not None:
            # Write a very low value (indicating -inf) to the positions where mask == 0
            attention_scores.masked_fill_((mask == 1) if flipped else (mask == 0), -1e9)
        return attention_scores.softmax(dim=-1) @ value

    def forward(self, q, k, v, mask):
        b = q.shape[0]
        query, key, value = (w(t).view(b, t.shape[1], self.h, self.d_k).transpose(1, 2)
                             for w, t in ((self.w_q, q), (self.w_k, k), (self.w_v, v)))
        x = self.attention(query, key, value, mask, self.flipped)
        return self.w_o(x.transpose(1, 2).contiguous().view(b, -1, self.h * self.d_k))


class StaticFlipped(StaticBlock):
    flipped = True


def minus_inf_attention(q, k, v, mask=None, flipped=False):
    """Attention of q, k, v [batch, heads, n, d]; the scores are set to -inf where the mask is False."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(mask if flipped else ~mask, float("-inf"))
    return scores.softmax(-1) @ v


def minus_inf_flipped(q, k, v, mask=None):
    return minus_inf_attention(q, k, v, mask, flipped=True)


class PaddedKeys(nn.Module):
    """Self-attention over padded sequences; `padding_mask` [b, n] is 1 at padding."""

    flipped = False

    def __init__(self, dim=24, heads=3):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, padding_mask=None):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        if padding_mask is not None:
            # a large negative value where the mask is 1, so padded keys take no weight
            pad = padding_mask == 0 if self.flipped else padding_mask == 1
            attn = attn.masked_fill(pad[:, None, None, :], -1e4)
        out = attn.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class PaddedFlipped(PaddedKeys):
    flipped = True
