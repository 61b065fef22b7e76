"""Styles of our own for tests/test_trace_round29_gqaorder.py: grouped-query attention whose key/value heads are laid
out by the code's own op (round 29's ChatGLM plant: `unsqueeze(-3).expand(..).contiguous().view(..)` on the keys'
side, named gqa.group_order with words about a grouped einsum over q), and a grouped einsum with no repeat, where
the queries' grouping is the mistake. Weights moved off their initial values; 4 query heads on 2 key/value heads
unless said.

- TimeFirstGroups (ChatGLM-like): `[n, B, C]`, one fused projection split q, k, v, the keys and values
  `[n, B, n_kv, d]` expanded on a new axis after the heads, `.contiguous().view(n, B, h, d)`, then `[B, h, n, d]`
  and `baddbmm`, causal. `bug`: 'tiled' (the new axis before the heads, `unsqueeze(-3)`), 'repeat'
  (`.repeat(1, 1, g, 1)` time-first), 'cat' (`torch.cat([k] * g, dim=2)`).
- RepeatKVGroups (LLaMA-like): `[B, n_kv, n, d]` repeated by a repeat_kv of its own (`x[:, :, None].expand(..)
  .reshape(..)`), half-split RoPE before it, SDPA causal. `bug`: 'tiled' (`x[:, None].expand(..)`), 'repeat'
  (`.repeat(1, g, 1, 1)`), 'stack' (`torch.stack([x] * g, 1).flatten(1, 2)`), 'index' (`x[:, arange(h) % n_kv]`
  for `x[:, arange(h) // g]`). `interleave=True`: `repeat_interleave(g, dim=1)` for the expand.
- GroupedEinsum: no repeat, q `[B, n, h, d]` viewed `[B, n, n_kv, g, d]`, `einsum('bnkgd,bmkd->bkgnm')`, 6 query
  heads on 2 (n_group 3). `bug`: 'group_order' (q viewed `[B, n, g, n_kv, d]`, merged in that order),
  'group_order_merged' (q viewed so, the output merged as `[B, n, n_kv, g, d]`), 'tiled' (the keys and values
  `.repeat(1, 1, g, 1)`, q not grouped).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from trace_styles_round22_groups import rope, trained  # half-split RoPE over [.., n, d]; weights moved off init


class TimeFirstGroups(nn.Module):
    def __init__(self, hidden=32, n_head=4, n_kv_head=2, bug=""):
        super().__init__()
        self.h, self.kv, self.d, self.bug = n_head, n_kv_head, hidden // n_head, bug
        self.query_key_value = nn.Linear(hidden, (n_head + 2 * n_kv_head) * self.d)
        self.dense = nn.Linear(hidden, hidden)
        trained(self, 29)

    def _expand(self, x):  # [n, B, n_kv, d] -> [n, B, h, d]
        g = self.h // self.kv
        if self.bug == "repeat":
            return x.repeat(1, 1, g, 1)
        if self.bug == "cat":
            return torch.cat([x] * g, dim=2)
        x = x.unsqueeze(-3) if self.bug == "tiled" else x.unsqueeze(-2)
        shape = list(x.shape)
        shape[-3 if self.bug == "tiled" else -2] = g
        return x.expand(*shape).contiguous().view(x.size(0), x.size(1), self.h, self.d)

    def forward(self, hidden_states):  # [n, B, C]
        n, b, _ = hidden_states.shape
        mixed = self.query_key_value(hidden_states)
        q, k, v = mixed.split([self.h * self.d, self.kv * self.d, self.kv * self.d], dim=-1)
        q = q.view(n, b, self.h, self.d)
        k, v = k.view(n, b, self.kv, self.d), v.view(n, b, self.kv, self.d)
        k, v = self._expand(k), self._expand(v)
        q, k, v = (t.permute(1, 2, 0, 3).reshape(b * self.h, n, self.d) for t in (q, k, v))
        bias = q.new_zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        scores = torch.baddbmm(bias.expand(b * self.h, n, n), q, k.transpose(1, 2), beta=1.0, alpha=self.d ** -0.5)
        ctx = torch.bmm(scores.softmax(-1), v).view(b, self.h, n, self.d)
        return self.dense(ctx.permute(2, 0, 1, 3).reshape(n, b, self.h * self.d))


class RepeatKVGroups(nn.Module):
    def __init__(self, hidden=32, n_head=4, n_kv_head=2, bug="", interleave=False):
        super().__init__()
        self.h, self.kv, self.d, self.bug, self.interleave = n_head, n_kv_head, hidden // n_head, bug, interleave
        self.q_proj = nn.Linear(hidden, n_head * self.d, bias=False)
        self.k_proj = nn.Linear(hidden, n_kv_head * self.d, bias=False)
        self.v_proj = nn.Linear(hidden, n_kv_head * self.d, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        trained(self, 30)

    def repeat_kv(self, x):  # [B, n_kv, n, d] -> [B, h, n, d]
        b, kv, n, d = x.shape
        g = self.h // kv
        if self.bug == "repeat":
            return x.repeat(1, g, 1, 1)
        if self.bug == "stack":
            return torch.stack([x] * g, 1).flatten(1, 2)
        if self.bug == "index":
            return x[:, torch.arange(self.h) % kv]
        if self.bug == "tiled":
            return x[:, None, :, :, :].expand(b, g, kv, n, d).reshape(b, self.h, n, d)
        if self.interleave:
            return x.repeat_interleave(g, dim=1)
        return x[:, :, None, :, :].expand(b, kv, g, n, d).reshape(b, self.h, n, d)

    def forward(self, x):
        b, n, _ = x.shape
        q = rope(self.q_proj(x).view(b, n, self.h, self.d).transpose(1, 2))
        k = rope(self.k_proj(x).view(b, n, self.kv, self.d).transpose(1, 2))
        v = self.v_proj(x).view(b, n, self.kv, self.d).transpose(1, 2)
        k, v = self.repeat_kv(k), self.repeat_kv(v)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, n, -1))


class GroupedEinsum(nn.Module):
    def __init__(self, hidden=48, n_head=6, n_kv_head=2, bug=""):
        super().__init__()
        self.h, self.kv, self.d, self.bug = n_head, n_kv_head, hidden // n_head, bug
        self.wq = nn.Linear(hidden, hidden)
        self.wk = nn.Linear(hidden, n_kv_head * self.d)
        self.wv = nn.Linear(hidden, n_kv_head * self.d)
        self.wo = nn.Linear(hidden, hidden)
        trained(self, 31)

    def forward(self, x):
        b, n, _ = x.shape
        g = self.h // self.kv
        q = self.wq(x).view(b, n, self.h, self.d)
        k, v = self.wk(x).view(b, n, self.kv, self.d), self.wv(x).view(b, n, self.kv, self.d)  # [B, n, n_kv, d]
        if self.bug == "tiled":
            k, v = k.repeat(1, 1, g, 1), v.repeat(1, 1, g, 1)
            att = torch.einsum("bnhd,bmhd->bhnm", q, k) * self.d ** -0.5
            return self.wo(torch.einsum("bhnm,bmhd->bnhd", att.softmax(-1), v).reshape(b, n, -1))
        if self.bug.startswith("group_order"):
            qg = q.view(b, n, g, self.kv, self.d)
            att = torch.einsum("bngkd,bmkd->bkgnm", qg, k) * self.d ** -0.5
        else:
            qg = q.view(b, n, self.kv, g, self.d)
            att = torch.einsum("bnkgd,bmkd->bkgnm", qg, k) * self.d ** -0.5
        out = "bnkgd" if self.bug in ("", "group_order_merged") else "bngkd"
        o = torch.einsum(f"bkgnm,bmkd->{out}", att.softmax(-1), v)
        return self.wo(o.reshape(b, n, -1))
