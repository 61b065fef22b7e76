"""Round 26's styles: an XLM-like layer whose one mask parameter takes key padding [bs, klen] or a whole mask
[bs, qlen, klen] (told apart by `mask.dim()`), beside a `head_mask` it multiplies into its weights after the softmax,
and whose decode cache is a dict keyed its own way, `{"length": n_cached, self.layer_idx: (k, v)}`; a padding-only
layer whose `head_mask` is its only other "mask" (no parameter of it takes a causal rule); a CTRL-like layer whose
forward takes `(value, key, query, attention_mask, past=None)` without defaults, its cache a pair kept sequence-major
`[bs, n, heads, d]`. Plants: the cache joined after the new keys, the scale left out, the heads merged without
their transpose."""

import itertools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from _trace_ref import trained


class KeyedCacheLayer(nn.Module):
    """XLM-like: `mask` [bs, klen] (key padding) or [bs, qlen, klen] (causal), 1 = may attend, turned into a
    boolean of masked places and filled with finfo.min; `head_mask` multiplies the weights; the cache a dict whose
    "length" says how many positions it holds and whose entry under the module's `layer_idx` holds (k, v)
    [bs, heads, n, d]. Heads by einsum."""

    COUNTER = itertools.count()

    def __init__(self, width=48, heads=4, bug=None):
        super().__init__()
        self.layer_idx = next(KeyedCacheLayer.COUNTER)
        self.heads, self.bug = heads, bug
        self.query, self.key, self.value = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)
        trained(self, 26)

    def forward(self, hidden, mask, cache=None, head_mask=None):
        bs, qlen, width = hidden.shape
        klen = qlen if cache is None else cache["length"] + qlen
        d = width // self.heads
        q = self.query(hidden).unflatten(-1, (self.heads, d)).permute(0, 2, 1, 3)
        k = self.key(hidden).unflatten(-1, (self.heads, d)).permute(0, 2, 1, 3)
        v = self.value(hidden).unflatten(-1, (self.heads, d)).permute(0, 2, 1, 3)
        if cache is not None:
            if self.layer_idx in cache:
                old_k, old_v = cache[self.layer_idx]
                if self.bug == "cache_order":
                    k, v = torch.cat([k, old_k], dim=2), torch.cat([v, old_v], dim=2)
                else:
                    k, v = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
            cache[self.layer_idx] = (k, v)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k)
        if self.bug != "no_scale":
            scores = scores / math.sqrt(d)
        shape = (bs, 1, qlen, klen) if mask.dim() == 3 else (bs, 1, 1, klen)
        hidden_out = mask.reshape(shape) == 0
        scores = scores.masked_fill(hidden_out, torch.finfo(scores.dtype).min)
        weights = scores.softmax(dim=-1)
        if head_mask is not None:
            weights = weights * head_mask
        out = torch.einsum("bhqk,bhkd->bhqd", weights, v)
        if self.bug == "merge_no_transpose":
            out = out.reshape(bs, qlen, width)
        else:
            out = out.permute(0, 2, 1, 3).reshape(bs, qlen, width)
        return (self.proj(out),)


class PaddingOnly(nn.Module):
    """Bidirectional: `mask` is key padding [bs, klen] alone (1 = a real token); `head_mask` scales each head's
    weights after the softmax. Nothing of it takes a causal rule."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        trained(self, 26)

    def forward(self, x, mask, head_mask=None):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(c // self.heads)
        scores = scores + (1.0 - mask[:, None, None, :].to(scores.dtype)) * -1e9
        weights = scores.softmax(-1)
        if head_mask is not None:
            weights = weights * head_mask
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, c))


class ThreeInputLayer(nn.Module):
    """CTRL-like: `forward(value, key, query, attention_mask, past=None)`, each of value, key, query without a
    default (the block hands it the same normed x three times); `attention_mask` added to the scores (0 / -inf);
    `past` = (past_k, past_v) sequence-major [bs, n, heads, d], joined on dim 1."""

    def __init__(self, d_model=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.w_value, self.w_key, self.w_query = (nn.Linear(d_model, d_model) for _ in range(3))
        self.dense = nn.Linear(d_model, d_model)
        trained(self, 26)

    def forward(self, value, key, query, attention_mask, past=None):
        bs, n, d_model = query.shape
        depth = d_model // self.num_heads
        q = self.w_query(query).reshape(bs, n, self.num_heads, depth)
        k = self.w_key(key).reshape(bs, -1, self.num_heads, depth)
        v = self.w_value(value).reshape(bs, -1, self.num_heads, depth)
        if past is not None:
            past_k, past_v = past
            if self.bug == "cache_order":
                k, v = torch.cat((k, past_k), dim=1), torch.cat((v, past_v), dim=1)
            else:
                k, v = torch.cat((past_k, k), dim=1), torch.cat((past_v, v), dim=1)
        logits = torch.matmul(q.transpose(1, 2), k.permute(0, 2, 3, 1))
        if self.bug != "no_scale":
            logits = logits / math.sqrt(depth)
        logits = logits + attention_mask
        weights = F.softmax(logits, dim=-1)
        out = torch.matmul(weights, v.transpose(1, 2)).transpose(1, 2).reshape(bs, n, d_model)
        return self.dense(out), (k, v)
