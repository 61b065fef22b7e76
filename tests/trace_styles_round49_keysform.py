"""Mistral's attention as transformers 4.42 to 4.47 wrote it, with the mask helper that model passed it
(`_prepare_4d_causal_attention_mask_with_cache_position`) called inside: a 4-D mask is taken as it is, a 2-D one
(1 = token, 0 = padding) is made into the causal mask with the sliding window OR-ed in and the padding filled with
finfo.min (`padding_mask = causal_mask + attention_mask; padding_mask == 0`). GQA by repeat_kv, RoPE half-split.

Plants (bug=...): 'window_only_cached' (the window only for a sliding cache: no window without one),
'softmax_queries' (softmax over dim=-2)."""

import math

import torch
from torch import nn


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def _repeat_kv(x, n_rep):
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def _causal_4d(attention_mask, q_len, dtype, cache_position, batch, window, cached, bug):
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask  # the caller's, as it is
    low = torch.finfo(dtype).min
    causal = torch.full((q_len, q_len), fill_value=low, dtype=dtype)
    hidden = torch.arange(q_len) > cache_position.reshape(-1, 1)
    use_window = cached if bug == "window_only_cached" else not cached
    if window is not None and use_window:
        hidden.bitwise_or_(torch.arange(q_len) <= cache_position.reshape(-1, 1) - window)
    causal = (causal * hidden)[None, None].expand(batch, 1, -1, -1)
    if attention_mask is not None:
        causal = causal.clone()
        padding = (causal + attention_mask[:, None, None, :]) == 0
        causal = causal.masked_fill(padding, low)
    return causal


class MistralSdpaFreeAttention(nn.Module):
    def __init__(self, hidden=40, heads=4, kv_heads=2, window=3, theta=10000.0, bug=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.window, self.bug = window, bug
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        inv = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.kv_heads, self.head_dim).transpose(1, 2)
        cache_position = torch.arange(q_len)
        freqs = cache_position[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = _repeat_kv(k, self.heads // self.kv_heads), _repeat_kv(v, self.heads // self.kv_heads)
        mask = _causal_4d(attention_mask, q_len, hidden_states.dtype, cache_position, bsz, self.window,
                          past_key_value is not None, self.bug)
        weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim) + mask
        weights = nn.functional.softmax(weights, dim=-2 if self.bug == "softmax_queries" else -1,
                                        dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out), weights
