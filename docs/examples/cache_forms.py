"""A decode step's cache in the forms code takes it besides one `(k, v)` in one parameter (docs/trace.md, "A cache in
your code's own layout"), each with a `bug`:

- `TwoParams`: `forward(x, past_key=None, past_value=None)`, the keys and values apart, each [B, H, N, D];
- `DictPast`: `forward(x, layer_past=None)` reading `layer_past["key"]` and `layer_past["value"]`;
- `BigCodeMQA`: GPTBigCode's multi-query attention, `layer_past` [B, N, 2·D] (one key/value head, keys and values
  joined on the last axis) joined with the new `key_value` on dim -2 and split `(head_dim, head_dim)` on dim -1.

bug="cache_order" joins the new keys before the cached ones; bug="is_causal" hands SDPA is_causal=True, which is
upper-left in a decode step.
"""

import torch
import torch.nn.functional as F
from torch import nn


def lower_right(n_new, n_keys):  # True = may attend: the new queries come after the cached keys
    return torch.ones(n_new, n_keys, dtype=torch.bool).tril(n_keys - n_new)


class TwoParams(nn.Module):
    def __init__(self, dim=32, n_heads=4, bug=None):
        super().__init__()
        self.n_heads, self.bug = n_heads, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, past_key=None, past_value=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)  # [B, H, T, D]
        if past_key is not None:
            k = torch.cat([k, past_key] if self.bug == "cache_order" else [past_key, k], dim=2)
            v = torch.cat([v, past_value] if self.bug == "cache_order" else [past_value, v], dim=2)
        if self.bug == "is_causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=lower_right(T, k.shape[2]))
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class DictPast(nn.Module):
    def __init__(self, dim=32, n_heads=4, bug=None):
        super().__init__()
        self.n_heads, self.d_head, self.bug = n_heads, dim // n_heads, bug
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, layer_past=None):
        B, T, C = x.shape
        q, k, v = (f(x).view(B, T, self.n_heads, self.d_head).transpose(1, 2) for f in (self.query, self.key,
                                                                                         self.value))
        if layer_past is not None:
            first = self.bug == "cache_order"
            k = torch.cat((k, layer_past["key"]) if first else (layer_past["key"], k), dim=-2)
            v = torch.cat((v, layer_past["value"]) if first else (layer_past["value"], v), dim=-2)
        if self.bug == "is_causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / self.d_head ** 0.5
            scores = scores.masked_fill(~lower_right(T, k.shape[-2]), float("-inf"))
            y = scores.softmax(dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class BigCodeMQA(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim, self.bug = embed_dim, num_heads, embed_dim // num_heads, bug
        self.c_attn = nn.Linear(embed_dim, embed_dim + 2 * self.head_dim)
        self.c_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, hidden_states, layer_past=None):
        query, key_value = self.c_attn(hidden_states).split((self.embed_dim, 2 * self.head_dim), dim=2)
        if layer_past is not None:
            first = self.bug == "cache_order"
            key_value = torch.cat((key_value, layer_past) if first else (layer_past, key_value), dim=-2)
        key, value = key_value.split((self.head_dim, self.head_dim), dim=-1)  # [B, N + T, D] each
        B, T, _ = query.shape
        query = query.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        key, value = key.unsqueeze(1), value.unsqueeze(1)  # one key/value head for all
        if self.bug == "is_causal":
            y = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(query, key, value, attn_mask=lower_right(T, key.shape[2]))
        return self.c_proj(y.transpose(1, 2).reshape(B, T, self.embed_dim))
