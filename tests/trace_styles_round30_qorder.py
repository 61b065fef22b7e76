"""Styles of our own for tests/test_trace_round30_qorder.py: grouped-query attention whose QUERY heads the code lays
in another order than its checkpoint means (issue #41: diverged at Q_rot, or at Q_split / the scores without RoPE,
and named nothing). The key/value side is right in every one. Weights moved off their initial values.

- LlamaQOrder (HF-LLaMA-like): q_proj, k_proj, v_proj, o_proj; half-split RoPE; a repeat_kv of its own
  (`x[:, :, None].expand(..).reshape(..)`, query head h on key/value head h // g); eager matmuls, causal. 6 query
  heads on 2 (n_group 3). `bug`: 'kv_inner' (q viewed `[B, n, g, n_kv, d]`, moved to `[.., n_kv, g, ..]` and
  flattened: head h·n_kv + j laid at j·g + h), 'kv_outer' (the other way round: viewed `[B, n, n_kv, g, d]`, moved to
  `[.., g, n_kv, ..]`), 'dh' (q's features split `(d, h)` for `(h, d)`: `view(B, n, d, h).transpose(2, 3)`).
- FusedGroups (litgpt-like): one fused projection laid per key/value group `[q_0 .. q_{g-1}, k, v]`, split after a
  `view(B, n, n_kv, g + 2, d)`; interleaved RoPE; the keys and values expanded to the query heads; SDPA, causal. 4
  query heads on 2. `bug`: 'group_order' (q's `[B, n_kv, g, n, d]` block moved to `[B, g, n_kv, ..]` before
  flattening the heads: the order 0, 2, 1, 3).
- EinsumQOrder: `grouped_attention(q, k, v)`, a function of einsums over q `[B, n, h, d]` viewed `[B, n, n_kv, g, d]`,
  no RoPE, not causal; 6 query heads on 2. `bug`: 'index' (q's heads taken in the order the module's `order` buffer
  says, `q[:, :, self.order]`), 'dh' (q's features split `(d, h)`).
- NanoQ (nanoGPT-like): one fused c_attn split q | k | v, 4 heads (no grouping), no RoPE, SDPA causal. `bug`: 'dh'.
- ConfigRope (LLaMA-like): its RoPE base in `config.rope_parameters['rope_theta']` (TextConfig, transformers 5's
  form), none on the module. `bug`: 'forgot_base' (rotated at 10000).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from trace_styles_round22_groups import rope, trained  # half-split RoPE over [.., n, d]; weights moved off init


def rope_interleaved(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """GPT-J's pairs (2i, 2i + 1) over [.., n, d]."""
    n, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(n, dtype=torch.float64), inv).to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = angles.cos(), angles.sin()
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2)


class LlamaQOrder(nn.Module):
    def __init__(self, hidden=48, n_head=6, n_kv_head=2, bug=""):
        super().__init__()
        self.h, self.kv, self.d, self.bug = n_head, n_kv_head, hidden // n_head, bug
        self.q_proj = nn.Linear(hidden, n_head * self.d, bias=False)
        self.k_proj = nn.Linear(hidden, n_kv_head * self.d, bias=False)
        self.v_proj = nn.Linear(hidden, n_kv_head * self.d, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        trained(self, 301)

    def repeat_kv(self, x):
        b, kv, n, d = x.shape
        return x[:, :, None, :, :].expand(b, kv, self.h // kv, n, d).reshape(b, self.h, n, d)

    def split_queries(self, q):  # [B, n, h·d] -> [B, n, h, d]
        b, n, _ = q.shape
        g = self.h // self.kv
        if self.bug == "kv_inner":
            return q.view(b, n, g, self.kv, self.d).transpose(2, 3).reshape(b, n, self.h, self.d)
        if self.bug == "kv_outer":
            return q.view(b, n, self.kv, g, self.d).transpose(2, 3).reshape(b, n, self.h, self.d)
        if self.bug == "dh":
            return q.view(b, n, self.d, self.h).transpose(2, 3)
        return q.view(b, n, self.h, self.d)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        q = rope(self.split_queries(self.q_proj(hidden_states)).transpose(1, 2))
        k = rope(self.k_proj(hidden_states).view(b, n, self.kv, self.d).transpose(1, 2))
        v = self.v_proj(hidden_states).view(b, n, self.kv, self.d).transpose(1, 2)
        k, v = self.repeat_kv(k), self.repeat_kv(v)
        scores = torch.matmul(q, k.transpose(2, 3)) / self.d ** 0.5
        causal = torch.full((n, n), float("-inf"), dtype=scores.dtype).triu(1)
        weights = F.softmax(scores + causal, dim=-1)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(b, n, -1)
        return self.o_proj(out)


class FusedGroups(nn.Module):
    def __init__(self, n_embd=32, n_head=4, n_query_groups=2, bug=""):
        super().__init__()
        self.n_head, self.n_query_groups, self.head_size, self.bug = n_head, n_query_groups, n_embd // n_head, bug
        self.attn = nn.Linear(n_embd, (n_head + 2 * n_query_groups) * self.head_size, bias=True)
        self.proj = nn.Linear(n_embd, n_embd, bias=True)
        trained(self, 302)

    def forward(self, x):
        B, T, C = x.size()
        q_per_kv = self.n_head // self.n_query_groups
        qkv = self.attn(x).view(B, T, self.n_query_groups, q_per_kv + 2, self.head_size)
        qkv = qkv.permute(0, 2, 3, 1, 4)  # [B, n_query_groups, q_per_kv + 2, T, head_size]
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        q, k = rope_interleaved(q), rope_interleaved(k)  # [B, n_query_groups, q_per_kv (1), T, head_size]
        if self.bug == "group_order":
            q = q.transpose(1, 2)
        k = k.expand(B, self.n_query_groups, q_per_kv, T, self.head_size)
        v = v.expand(B, self.n_query_groups, q_per_kv, T, self.head_size)
        q = q.reshape(B, -1, T, self.head_size)
        k = k.reshape(B, -1, T, self.head_size)
        v = v.reshape(B, -1, T, self.head_size)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


def grouped_attention(q, k, v, n_kv):
    """q [B, n, h, d], k and v [B, m, n_kv, d] -> [B, n, h, d]; query head h on key/value head h // (h / n_kv)."""
    b, n, h, d = q.shape
    qg = q.view(b, n, n_kv, h // n_kv, d)
    att = torch.einsum("bnkgd,bmkd->bkgnm", qg, k) * d ** -0.5
    return torch.einsum("bkgnm,bmkd->bnkgd", att.softmax(-1), v).reshape(b, n, h, d)


class EinsumQOrder(nn.Module):
    def __init__(self, dim=48, heads=6, kv_heads=2, bug=""):
        super().__init__()
        self.h, self.kv, self.d, self.bug = heads, kv_heads, dim // heads, bug
        self.to_q = nn.Linear(dim, dim)
        self.to_kv = nn.Linear(dim, 2 * kv_heads * self.d)
        self.to_out = nn.Linear(dim, dim)
        self.register_buffer("order", torch.tensor([1, 4, 0, 5, 3, 2]))
        trained(self, 303)

    def forward(self, x):
        b, n, _ = x.shape
        if self.bug == "dh":
            q = self.to_q(x).view(b, n, self.d, self.h).transpose(-1, -2)
        else:
            q = self.to_q(x).view(b, n, self.h, self.d)
        if self.bug == "index":
            q = q[:, :, self.order]
        k, v = self.to_kv(x).view(b, n, 2, self.kv, self.d).unbind(2)
        return self.to_out(grouped_attention(q, k, v, self.kv).reshape(b, n, -1))


class TextConfig:
    """A transformers-5-like config: RoPE's base in its rope_parameters, none on the module itself."""

    def __init__(self, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0):
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}


class ConfigRope(nn.Module):
    """LLaMA-like, its RoPE base read from `config.rope_parameters['rope_theta']`; `bug='forgot_base'` rotates at
    rope()'s default 10000."""

    def __init__(self, config, bug=""):
        super().__init__()
        self.config, self.bug = config, bug
        self.h, self.kv = config.num_attention_heads, config.num_key_value_heads
        self.d = config.hidden_size // self.h
        self.q_proj = nn.Linear(config.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv * self.d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv * self.d, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        trained(self, 304)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        base = 10000.0 if self.bug == "forgot_base" else self.config.rope_parameters["rope_theta"]
        q = rope(self.q_proj(hidden_states).view(b, n, self.h, self.d).transpose(1, 2), base)
        k = rope(self.k_proj(hidden_states).view(b, n, self.kv, self.d).transpose(1, 2), base)
        v = self.v_proj(hidden_states).view(b, n, self.kv, self.d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, n, -1))


class NanoQ(nn.Module):
    """nanoGPT-like: one fused c_attn split q | k | v, 4 heads, no RoPE, SDPA causal. `bug='dh'`: q's features split
    `(d, h)` (`view(B, T, hs, n_head).transpose(2, 3)`)."""

    def __init__(self, n_embd=32, n_head=4, bug=""):
        super().__init__()
        self.n_head, self.n_embd, self.bug = n_head, n_embd, bug
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        trained(self, 305)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        hs = C // self.n_head
        if self.bug == "dh":
            q = q.view(B, T, hs, self.n_head).transpose(2, 3).transpose(1, 2)
        else:
            q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
