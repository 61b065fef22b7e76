"""Decode steps of code whose head count only its run says (held-out round 13a: ChatGLM's SelfAttention keeps it as
num_attention_heads_per_partition): trace draws --cache's keys with the count a run without the cache reads. Three
styles, each with a cache-order plant (`new_first`: the new keys joined before the cached ones)."""

import torch
import torch.nn.functional as F
from torch import nn


class GlmLike(nn.Module):
    """ChatGLM2's SelfAttention, shrunk: time-first [s, b, h], a fused query_key_value with multi-query groups, the
    cache a (k, v) pair [s, b, g, d], the groups expanded for the heads; its counts under names of its own."""

    def __init__(self, hidden=32, heads=4, groups=2, bug=None):
        super().__init__()
        self.heads_per_partition, self.groups_per_partition, self.hn = heads, groups, hidden // heads
        self.query_key_value = nn.Linear(hidden, hidden + 2 * groups * self.hn)
        self.dense = nn.Linear(hidden, hidden, bias=False)
        self.bug = bug

    def forward(self, hidden_states, kv_cache=None):
        sq, b, _ = hidden_states.shape
        mixed = self.query_key_value(hidden_states)
        q, k, v = mixed.split([self.heads_per_partition * self.hn, self.groups_per_partition * self.hn,
                               self.groups_per_partition * self.hn], dim=-1)
        q = q.view(sq, b, self.heads_per_partition, self.hn)
        k = k.view(sq, b, self.groups_per_partition, self.hn)
        v = v.view(sq, b, self.groups_per_partition, self.hn)
        if kv_cache is not None:
            cache_k, cache_v = kv_cache
            first = (k, cache_k) if self.bug == "new_first" else (cache_k, k)
            k, v = torch.cat(first, dim=0), torch.cat((v, cache_v) if self.bug == "new_first" else (cache_v, v), 0)
        rep = self.heads_per_partition // self.groups_per_partition
        k = k.unsqueeze(-2).expand(-1, -1, -1, rep, -1).reshape(k.shape[0], b, self.heads_per_partition, self.hn)
        v = v.unsqueeze(-2).expand(-1, -1, -1, rep, -1).reshape(v.shape[0], b, self.heads_per_partition, self.hn)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        mask = torch.ones(sq, k.shape[2], dtype=torch.bool).tril(k.shape[2] - sq)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.dense(y.permute(2, 0, 1, 3).reshape(sq, b, -1))


class DictConfigured(nn.Module):
    """A module built from a plain dict, its count kept as `nh_local`; batch-first, the cache a pair [b, h, s, d]
    joined on dim 2, a causal mask of its own for the new rows."""

    def __init__(self, cfg=None, bug=None):
        super().__init__()
        cfg = cfg or {"width": 32, "n": 4}
        self.nh_local, self.hs = cfg["n"], cfg["width"] // cfg["n"]
        self.qkv = nn.Linear(cfg["width"], 3 * cfg["width"], bias=False)
        self.out = nn.Linear(cfg["width"], cfg["width"])
        self.bug = bug

    def forward(self, x, past=None):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.nh_local, self.hs).permute(2, 0, 3, 1, 4)
        if past is not None:
            k = torch.cat([k, past[0]] if self.bug == "new_first" else [past[0], k], dim=2)
            v = torch.cat([v, past[1]] if self.bug == "new_first" else [past[1], v], dim=2)
        n = k.shape[2]
        scores = q @ k.transpose(-2, -1) / self.hs ** 0.5
        scores = scores.masked_fill(~torch.ones(t, n, dtype=torch.bool).tril(n - t), float("-inf"))
        y = scores.softmax(-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class LiteralHeads(nn.Module):
    """The head count a literal in the forward (`view(b, t, 4, -1)`), separate projections, the cache a dict of
    'k' and 'v' [b, h, s, d]."""

    def __init__(self, d=32, bug=None):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d) for _ in range(4))
        self.bug = bug

    def forward(self, x, layer_past=None):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, 4, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if layer_past is not None:
            k = torch.cat((k, layer_past["k"]) if self.bug == "new_first" else (layer_past["k"], k), dim=-2)
            v = torch.cat((v, layer_past["v"]) if self.bug == "new_first" else (layer_past["v"], v), dim=-2)
        mask = torch.ones(t, k.shape[-2], dtype=torch.bool).tril(k.shape[-2] - t)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class NeedsItsCache(nn.Module):
    """A literal head count, and a cache the forward cannot run without (no default): no run says the count."""

    def __init__(self, d=32):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, kv_cache):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, 4, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        k, v = torch.cat((kv_cache[0], k), 2), torch.cat((kv_cache[1], v), 2)
        mask = torch.ones(t, k.shape[2], dtype=torch.bool).tril(k.shape[2] - t)
        return self.wo(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, -1))
