"""Styles for tests/test_trace_round22_maskargs.py: attention that takes a key-padding mask `[n_batch, n_K]`, its
keys from an optional memory (a module's `context=None`), from an input of their own (a function's k), or from its
one input (self-attention), traced with a mask file whose shape the other flags do not fit. Each takes `bug` (a
plant) and is written in one library's idiom."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _trained(*linears: nn.Linear) -> None:
    """Move each Linear off its initial values (biases away from their small uniform start)."""
    with torch.no_grad():
        for i, linear in enumerate(linears):
            linear.weight.mul_(1.2 + 0.1 * i)
            if linear.bias is not None:
                linear.bias.add_(0.04 * (i + 1))


class PerceiverCross(nn.Module):
    """perceiver-pytorch's Attention: `context = default(context, x)`, one to_kv chunked in two, einsum scores,
    mask [b, j] of booleans (True = a real key) filled with -finfo.max."""

    def __init__(self, query_dim: int = 16, heads: int = 2, dim_head: int = 8, bug: str = ""):
        super().__init__()
        inner = heads * dim_head
        self.scale, self.heads, self.bug = dim_head ** -0.5, heads, bug
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_kv = nn.Linear(query_dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, query_dim)
        _trained(self.to_q, self.to_kv, self.to_out)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        h = self.heads
        context = x if context is None else context
        q = self.to_q(x)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        q, k, v = (t.unflatten(-1, (h, -1)).transpose(1, 2) for t in (q, k, v))  # [b, n, h·d] -> [b, h, n, d]
        sim = torch.einsum("bhid,bhjd->bhij", q, k)
        if self.bug != "no_scale":
            sim = sim * self.scale
        if mask is not None:
            sim = sim.masked_fill(~mask.bool()[:, None, None, :], -torch.finfo(sim.dtype).max)  # [b, 1, 1, j]
        attn = sim.softmax(dim=-1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(out.transpose(1, 2).flatten(2))  # [b, h, i, d] -> [b, i, h·d]


class BartLike(nn.Module):
    """BART's attention: `key_value_states=None` for cross-attention, the query scaled by its projection's side,
    a 2-D attention_mask of 0/1 turned into an additive bias of finfo.min."""

    def __init__(self, embed_dim: int = 16, num_heads: int = 4, bug: str = ""):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        self.scaling = self.head_dim ** -0.5
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))
        _trained(self.q_proj, self.k_proj, self.v_proj, self.out_proj)

    def _shape(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], t.shape[1], self.num_heads, self.head_dim).transpose(1, 2)  # [b, h, n, d]

    def forward(self, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        source = hidden_states if key_value_states is None else key_value_states
        q = self._shape(self.q_proj(hidden_states) * self.scaling)
        k, v = self._shape(self.k_proj(source)), self._shape(self.v_proj(source))
        scores = q @ k.transpose(-1, -2)  # [b, h, n_Q, n_K]
        if self.bug == "scale_twice":
            scores = scores * self.scaling
        if attention_mask is not None:
            keep = attention_mask[:, None, None, :].to(scores.dtype)
            scores = scores + (1.0 - keep) * torch.finfo(scores.dtype).min
        out = scores.softmax(-1) @ v
        return self.out_proj(out.transpose(1, 2).reshape(hidden_states.shape))


class SdpaMemory(nn.Module):
    """A torch-style block over F.scaled_dot_product_attention: `memory=None`, key_padding_mask True = padded
    (nn.MultiheadAttention's convention), inverted into SDPA's attn_mask."""

    def __init__(self, d_model: int = 16, nhead: int = 2, bug: str = ""):
        super().__init__()
        self.nhead, self.bug = nhead, bug
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d_model, d_model) for _ in range(4))
        _trained(self.wq, self.wk, self.wv, self.wo)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        mem = x if memory is None else memory
        q, k, v = (w(t).unflatten(-1, (self.nhead, -1)).transpose(1, 2)
                   for w, t in ((self.wq, x), (self.wk, mem), (self.wv, mem)))  # [b, h, n, d]
        allowed = None if key_padding_mask is None else ~key_padding_mask.bool()[:, None, None, :]
        scale = 1.0 if self.bug == "no_scale" else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        return self.wo(out.transpose(1, 2).flatten(2))


class SelfPadded(nn.Module):
    """Self-attention alone (no memory): forward(x, mask) with mask [b, n] of 0/1, HF's 2-D attention_mask."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        _trained(self.qkv, self.proj)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)  # 3 x [b, h, n, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.bool()[:, None, None, :])
        return self.proj(out.transpose(1, 2).flatten(2))


def padded_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A function over heads' tensors [b, h, n, d], keys given apart, mask [b, n_K] (True = a real key)."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
    return scores.softmax(-1) @ v
