"""Styles for tests/test_trace_r12b.py, each written as a real library writes it.

A memory parameter no name gives away, read from the data flow:
- `VisionCrossAttention`: Mllama's / IDEFICS 2's text-to-image cross-attention (q/k/v/o Linear layers, GQA, per-head
  RMS qk-norm), `forward(hidden_states, vision_states=None, past=None, attention_mask=None, output_attentions=None)`;
  with no vision states it reads its keys and values from the cache, so run with None it raises.
- `LatentCross`: a Perceiver-style block whose latents attend to `kv_input=None` (themselves when None), beside an
  optional `pos=None` added to the queries' input, listed first.
- `attend_source`: a function taking its weights as arguments, `attend_source(x, W_q, W_k, W_v, W_o, n_head,
  scale=None, source=None)`, whose keys and values read `source` (x when None).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * (0.3 if p.dim() > 1 else 0.2) + (1 if p.dim() == 1
                                                                                                  else 0))


class HeadRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class VisionCrossAttention(nn.Module):
    def __init__(self, hidden=32, heads=4, kv_heads=2, layer=0, bug=None):
        super().__init__()
        self.num_heads, self.num_kv, self.head_dim, self.layer, self.bug = heads, kv_heads, hidden // heads, layer, bug
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.q_norm = HeadRMSNorm(self.head_dim)
        self.k_norm = HeadRMSNorm(self.head_dim)
        _trained(self, 1)

    def forward(self, hidden_states, vision_states=None, past=None, attention_mask=None, output_attentions=None):
        b, n, _ = hidden_states.shape
        q = self.q_norm(self.q_proj(hidden_states).view(b, n, self.num_heads, self.head_dim).transpose(1, 2))
        if vision_states is not None:
            k = self.k_proj(vision_states).view(b, -1, self.num_kv, self.head_dim).transpose(1, 2)
            v = self.v_proj(vision_states).view(b, -1, self.num_kv, self.head_dim).transpose(1, 2)
            k = self.k_norm(k)
        else:  # the image was seen at prefill: its keys and values are in the cache
            k, v = past[self.layer]
        group = self.num_heads // self.num_kv
        k = k.repeat_interleave(group, dim=1)
        v = (k if self.bug == "v_from_k" else v.repeat_interleave(group, dim=1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            scores = scores + attention_mask
        weights = scores.softmax(dim=-2 if self.bug == "softmax_queries" else -1)
        out = (weights @ v).transpose(1, 2).reshape(b, n, -1)
        return self.o_proj(out), (weights if output_attentions else None)


class LatentCross(nn.Module):
    def __init__(self, dim=24, heads=3, dim_head=8, bug=None):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.scale, self.bug = heads, dim_head ** -0.5, bug
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, dim)
        _trained(self, 2)

    def forward(self, latents, pos=None, kv_input=None):
        if pos is not None:
            latents = latents + pos
        source = latents if kv_input is None else kv_input
        q = self.to_q(latents)
        k, v = self.to_kv(source).chunk(2, dim=-1)
        b, h = q.shape[0], self.heads
        q, k, v = (t.reshape(b, t.shape[1], h, -1).permute(0, 2, 1, 3) for t in (q, k, v))
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * (1.0 if self.bug == "no_scale" else self.scale)
        attn = sim.softmax(dim=-1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, out.shape[2], -1))


def attend_source(x, W_q, W_k, W_v, W_o, n_head, scale=None, source=None):
    source = x if source is None else source
    q, k, v = x @ W_q, source @ W_k, source @ W_v
    b, n, d = q.shape
    q = q.view(b, n, n_head, d // n_head).transpose(1, 2)
    k = k.view(b, -1, n_head, d // n_head).transpose(1, 2)
    v = v.view(b, -1, n_head, d // n_head).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, scale=scale)
    return y.transpose(1, 2).reshape(b, n, d) @ W_o


def attend_source_d_model(x, W_q, W_k, W_v, W_o, n_head, scale=None, source=None):
    """A plant: the scores divided by √d_model."""
    return attend_source(x, W_q, W_k, W_v, W_o, n_head, scale=1 / math.sqrt(x.shape[-1]), source=source)
