"""A decode step's cache in the forms code takes it besides one `(k, v)` in one parameter (docs/trace.md, "A cache in
your code's own layout"), each with a `bug`:

- `TwoParams`: `forward(x, past_key=None, past_value=None)`, the keys and values apart, each [B, H, N, D];
- `DictPast`: `forward(x, layer_past=None)` reading `layer_past["key"]` and `layer_past["value"]`;
- `BigCodeMQA`: GPTBigCode's multi-query attention, `layer_past` [B, N, 2·D] (one key/value head, keys and values
  joined on the last axis) joined with the new `key_value` on dim -2 and split `(head_dim, head_dim)` on dim -1.

- `LatentUpdate`: multi-head latent attention (DeepSeek-V3's, transformers 4's DeepseekV3Attention shrunk: a query
  latent, kv_a_proj_with_mqa -> RMSNorm -> kv_b_proj, one rotary key part for every head) whose cache is transformers'
  Cache object, `past_key_value.update(key_states, value_states, self.layer_idx)` joining every head's expanded keys
  [B, H, N, d_K] and values [B, H, N, d_V], the new tokens rotated after `get_seq_length()`.

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


class LatentUpdate(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, q_lora_rank=10, kv_lora_rank=12, qk_nope_head_dim=8,
                 qk_rope_head_dim=4, v_head_dim=6, layer_idx=0, bug=None):
        super().__init__()
        self.num_heads, self.layer_idx, self.bug = num_heads, layer_idx, bug
        self.nope, self.rope_dim, self.v_head_dim, self.rank = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, \
            kv_lora_rank
        self.q_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
        self.q_a_layernorm = nn.RMSNorm(q_lora_rank, eps=1e-6)
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)

    def rotate(self, t, start):  # half-split, positions start ..
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, self.rope_dim, 2).float() / self.rope_dim)
        emb = torch.outer(torch.arange(start, start + t.shape[-2]).float(), inv_freq)
        emb = torch.cat((emb, emb), dim=-1)
        half = self.rope_dim // 2
        return t * emb.cos() + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * emb.sin()

    def forward(self, hidden_states, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        past = past_key_value.get_seq_length() if past_key_value is not None else 0
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(bsz, q_len, self.num_heads, self.q_head_dim).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope_dim], dim=-1)
        compressed_kv, k_pe = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.rank, self.rope_dim], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed_kv))
        kv = kv.view(bsz, q_len, self.num_heads, self.nope + self.v_head_dim).transpose(1, 2)
        k_nope, value_states = torch.split(kv, [self.nope, self.v_head_dim], dim=-1)
        q_pe, k_pe = self.rotate(q_pe, past), self.rotate(k_pe.view(bsz, 1, q_len, self.rope_dim), past)
        query_states = torch.cat([q_nope, q_pe], dim=-1)
        key_states = torch.cat([k_nope, k_pe.expand(-1, self.num_heads, -1, -1)], dim=-1)
        if past_key_value is not None:
            if self.bug == "cache_order":
                held_k, held_v = past_key_value[self.layer_idx]
                key_states, value_states = torch.cat([key_states, held_k], 2), torch.cat([value_states, held_v], 2)
            else:
                key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx)
        n_k = key_states.shape[2]
        mask = None if self.bug == "is_causal" else lower_right(q_len, n_k)
        y = F.scaled_dot_product_attention(query_states, key_states, value_states, attn_mask=mask,
                                           is_causal=self.bug == "is_causal")
        return self.o_proj(y.transpose(1, 2).reshape(bsz, q_len, -1))
