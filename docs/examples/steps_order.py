"""Mistakes where the code's order of steps is not the reference's (docs/trace.md, "Causes named by experiment"):
each is rerun where the code makes it, and named by experiment.

    attnscope trace docs/examples/steps_order.py:MaskFirst --init "bug='upper_left'" --causal --cache 3
    attnscope trace docs/examples/steps_order.py:PartialRope --init "bug='kv_swapped'" --rope --causal
    attnscope trace docs/examples/steps_order.py:KeepMask --init "bug='dropout_on'" --causal

- MaskFirst: GPT-J's `_attn`: the causal buffer sliced to the decode step's corner, `torch.where(causal, q @ kᵀ,
  finfo.min)` before `/ scale_attn`; `bug='upper_left'` slices the top-left corner.
- PartialRope: Phi's separate projections and partial rotary; `bug='kv_swapped'` takes the keys from v_proj and the
  values from k_proj, before RoPE.
- KeepMask: a flax port's dropout written by hand, a broadcast keep-mask drawn with torch.bernoulli, times
  1/keep_prob; `bug='dropout_on'` leaves it on at inference (`deterministic=False`).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MaskFirst(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, max_positions=32, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        causal = torch.tril(torch.ones(max_positions, max_positions, dtype=torch.bool))
        self.register_buffer("bias", causal.view(1, 1, max_positions, max_positions), persistent=False)
        self.scale_attn = math.sqrt(self.head_dim)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(embed_dim, embed_dim, bias=False) for _ in range(3))
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, hidden_states, layer_past=None):
        b, n, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, n, self.num_heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        if layer_past is not None:
            k, v = torch.cat((layer_past[0], k), dim=-2), torch.cat((layer_past[1], v), dim=-2)
        m = k.shape[-2]
        causal = self.bias[:, :, :n, :m] if self.bug == "upper_left" else self.bias[:, :, m - n:m, :m]
        w = torch.matmul(q, k.transpose(-1, -2))
        w = torch.where(causal, w, torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype))
        w = F.softmax(w / self.scale_attn, dim=-1)
        return self.out_proj(torch.matmul(w, v).transpose(1, 2).reshape(b, n, -1))


class PartialRope(nn.Module):
    def __init__(self, hidden_size=32, num_heads=2, partial_rotary_factor=0.5, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.partial_rotary_factor = partial_rotary_factor
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden_size, hidden_size) for _ in range(3))
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        b, n, _ = hidden_states.shape
        key_proj, value_proj = (self.v_proj, self.k_proj) if self.bug == "kv_swapped" else (self.k_proj, self.v_proj)
        q, k, v = (p(hidden_states).view(b, n, self.num_heads, -1).transpose(1, 2)
                   for p in (self.q_proj, key_proj, value_proj))
        r = int(self.partial_rotary_factor * self.head_dim)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, r, 2).float() / r)
        angles = torch.outer(torch.arange(n).float(), inv_freq)
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()

        def rotate(x):
            x1, x2 = x[..., : r // 2], x[..., r // 2: r]
            turned = torch.cat((-x2, x1), dim=-1)
            return torch.cat((x[..., :r] * cos + turned * sin, x[..., r:]), dim=-1)

        w = torch.matmul(rotate(q), rotate(k).transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            w = w + attention_mask
        out = torch.matmul(F.softmax(w, dim=-1), v)
        return self.dense(out.transpose(1, 2).reshape(b, n, -1))


class KeepMask(nn.Module):
    def __init__(self, features=32, num_heads=4, dropout_rate=0.1, bug=None):
        super().__init__()
        self.num_heads, self.dropout_rate, self.bug = num_heads, dropout_rate, bug
        self.query, self.key, self.value, self.out = (nn.Linear(features, features) for _ in range(4))

    def forward(self, inputs_q, mask=None, deterministic=True):
        if self.bug == "dropout_on":
            deterministic = False
        b, n, _ = inputs_q.shape
        q, k, v = (p(inputs_q).view(b, n, self.num_heads, -1) for p in (self.query, self.key, self.value))
        weights = torch.einsum("bqhd,bkhd->bhqk", q / math.sqrt(q.shape[-1]), k)
        if mask is not None:
            weights = torch.where(mask, weights, torch.finfo(weights.dtype).min)
        weights = torch.softmax(weights, dim=-1)
        if not deterministic:
            keep_prob = 1.0 - self.dropout_rate
            keep = torch.bernoulli(torch.full((1, 1) + weights.shape[-2:], keep_prob),
                                   generator=torch.Generator().manual_seed(0))
            weights = weights * (keep / keep_prob)
        return self.out(torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, n, -1))
