"""Attention modules written as real libraries write them, for tests/test_trace_round14_groups.py: code that reads
its mask by comparing it with a number (an additive mask compared with 0, -inf or finfo.min), dropout left on at
each place a library puts one, and attention over groups of tokens the module makes itself (MobileViT's
unfold / fold, a window partition, axial rows). Each class takes `bug`: None is the correct module, any other a
planted mistake."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# --- masks the code compares with a number ------------------------------------------------------------------------


class SlicedCompared(nn.Module):
    """transformers' eager attention of a decoder (Mistral, Jamba): a 4-D additive mask sliced to the keys and added;
    bug 'after': the mask applied to the weights after the softmax, as `masked_fill(mask < 0, 0.0)`."""

    def __init__(self, hidden_size: int = 32, num_heads: int = 4, bug: str | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        causal_mask = None if attention_mask is None else attention_mask[:, :, :, : k.shape[-2]]
        if causal_mask is not None and self.bug != "after":
            attn_weights = attn_weights + causal_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        if causal_mask is not None and self.bug == "after":
            attn_weights = attn_weights.masked_fill(causal_mask < 0, 0.0)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)


class WhereBelowZero(nn.Module):
    """A T5-like block that turns an additive mask back into a choice: `torch.where(mask < 0, finfo.min, scores)`
    (fused qkv, einsum); bug 'after': the weights of the masked keys zeroed after the softmax,
    `torch.where(mask < 0, 0, attn)`."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str | None = None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for t in self.to_qkv(x).chunk(3, dim=-1))
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
        if mask is not None and self.bug != "after":
            sim = torch.where(mask < 0, torch.finfo(sim.dtype).min, sim)
        attn = sim.softmax(dim=-1)
        if mask is not None and self.bug == "after":
            attn = torch.where(mask < 0, torch.zeros_like(attn), attn)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, -1))


class FinfoMinEquals(nn.Module):
    """Code that finds the masked cells of transformers' 4-D mask by `mask == torch.finfo(dtype).min` and fills
    them; bug 'after': the weights multiplied by `(mask > -1)` after the softmax."""

    def __init__(self, embed_dim: int = 32, num_heads: int = 4, bug: str | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, attn_mask=None):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = q @ k.transpose(-2, -1) * self.head_dim ** -0.5
        if attn_mask is not None and self.bug != "after":
            blocked = attn_mask == torch.finfo(attn_mask.dtype).min
            scores = scores.masked_fill(blocked, float("-inf"))
        probs = scores.softmax(dim=-1)
        if attn_mask is not None and self.bug == "after":
            probs = probs * (attn_mask > -1)
        out = (probs @ v).transpose(1, 2).reshape(b, n, c)
        return self.proj(out)


# --- dropout left on, wherever it sits ----------------------------------------------------------------------------


class ResidDropoutAfterProj(nn.Module):
    """GPT-2 / StarCoder2-like: the output projection, then `resid_dropout` on its output; bug 'on': F.dropout
    without `training=`, so it drops in eval() mode too."""

    def __init__(self, n_embd: int = 32, n_head: int = 4, p: float = 0.2, bug: str | None = None):
        super().__init__()
        self.n_head, self.p, self.bug = n_head, p, bug
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        if self.bug == "on":
            return F.dropout(y, self.p)
        return F.dropout(y, self.p, training=self.training)


class DropoutBeforeProj(nn.Module):
    """A hand-written block (einsum, separate projections) that drops the merged heads before its output
    projection; bug 'on': `F.dropout(out, p=self.p)`."""

    def __init__(self, dim: int = 32, heads: int = 4, p: float = 0.2, bug: str | None = None):
        super().__init__()
        self.heads, self.p, self.bug = heads, p, bug
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        dots = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(d // self.heads)
        dots = dots.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("bhij,bhjd->bhid", dots.softmax(-1), v).transpose(1, 2).reshape(b, n, d)
        out = F.dropout(out, p=self.p) if self.bug == "on" else F.dropout(out, p=self.p, training=self.training)
        return self.to_out(out)


class DropoutOnHeads(nn.Module):
    """The heads' output `[b, h, n, d_head]` dropped before the heads merge (matmul, one fused qkv); bug 'on':
    `nn.functional.dropout(context, self.p, True)`."""

    def __init__(self, hidden: int = 32, heads: int = 4, p: float = 0.2, bug: str | None = None):
        super().__init__()
        self.heads, self.p, self.bug = heads, p, bug
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, hidden_states):
        b, n, c = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) * (c // self.heads) ** -0.5
        scores = scores + torch.full((n, n), float("-inf")).triu(1)
        context = scores.softmax(dim=-1) @ v
        context = nn.functional.dropout(context, self.p, self.bug == "on" or self.training)
        return self.dense(context.transpose(1, 2).reshape(b, n, c))
