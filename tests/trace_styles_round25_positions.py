"""Round 25's attention blocks that take the tokens' positions as a required argument, read before or beside any
use of the input (Griffin's `segment_pos`, asserted [b, t] first): trace first hands that parameter what its name
or place says (an input, a position embedding, positions [n]); where the code raises on it, it is given the tokens'
positions, arange(n) [n], else one row for each sequence [n_batch, n], the first it runs on kept with a note.

- `SegmentPositionsBlock`: recurrentgemma-like: `assert segment_positions.shape == x.shape[:2]`, RoPE half-split from
  `positions[..., None] * inv_freq` [b, t, d/2], a causal band of `window` keys made by comparing the positions,
  einsum scores, masked_fill, softmax.
- `StepRotaryAttention`: GPT-J-like rotate-every-two from `step[..., None] * inv_freq` repeated by pairs, [b, t]
  positions under a neutral name (`step`), GQA by repeat_interleave, F.scaled_dot_product_attention(is_causal=True).
- `SeqPosAttention`: Meta-like complex RoPE from `torch.outer(seq_pos, inv_freq)` (positions [t]) and
  `torch.view_as_complex`, a causal mask from `seq_pos[:, None] >= seq_pos[None, :]`, matmul scores.
Plants: `window_off` (the band one key wider: mask.off_by_one), `scale_width` (SDPA's scale 1/√width:
scale.d_model), `merge_view` (heads merged by a view before the transpose: heads.merge_without_transpose).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from _trace_ref import trained
from torch import nn


class SegmentPositionsBlock(nn.Module):
    def __init__(self, width=32, num_heads=4, window=3, bug=None):
        super().__init__()
        self.h, self.d, self.window, self.bug = num_heads, width // num_heads, window, bug
        self.proj_q = nn.Linear(width, width, bias=True)
        self.proj_k = nn.Linear(width, width, bias=True)
        self.proj_v = nn.Linear(width, width, bias=True)
        self.proj_final = nn.Linear(width, width, bias=True)
        trained(self, 21, shift=0.0)

    def _rope(self, t, positions):
        inv = 1.0 / 10000.0 ** (torch.arange(0, self.d, 2, dtype=torch.float32) / self.d)
        angles = positions[..., None, None].float() * inv  # [b, t, 1, d/2]
        first, second = t.chunk(2, dim=-1)
        return torch.cat([first * angles.cos() - second * angles.sin(),
                          second * angles.cos() + first * angles.sin()], dim=-1)

    def forward(self, x, segment_positions):
        b, t, _ = x.shape
        assert segment_positions.shape == (b, t), segment_positions.shape
        q = self._rope(self.proj_q(x).reshape(b, t, self.h, self.d), segment_positions)  # [b, t, h, d]
        k = self._rope(self.proj_k(x).reshape(b, t, self.h, self.d), segment_positions)
        v = self.proj_v(x).reshape(b, t, self.h, self.d)
        qp, kp = segment_positions[:, :, None], segment_positions[:, None, :]
        reach = qp - kp <= self.window if self.bug == "window_off" else qp - kp < self.window
        seen = (qp >= kp) & reach  # [b, t, t]
        logits = torch.einsum("btnh,bsnh->bnts", q, k) * self.d ** -0.5
        logits = logits.masked_fill(~seen[:, None], float("-inf"))
        probs = logits.softmax(dim=-1)
        encoded = torch.einsum("bnts,bsnh->btnh", probs, v).reshape(b, t, -1)  # [b, t, h·d]
        return self.proj_final(encoded)


class StepRotaryAttention(nn.Module):
    def __init__(self, d_model=32, n_heads=4, n_kv_heads=2, bug=None):
        super().__init__()
        self.h, self.kv, self.d, self.bug = n_heads, n_kv_heads, d_model // n_heads, bug
        self.width = d_model
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, n_kv_heads * self.d, bias=False)
        self.wv = nn.Linear(d_model, n_kv_heads * self.d, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)
        trained(self, 22, shift=0.0)

    def forward(self, hidden_states, step):
        b, t, _ = hidden_states.shape
        inv = 1.0 / 10000.0 ** (torch.arange(0, self.d, 2, dtype=torch.float32) / self.d)
        angles = step.float()[..., None] * inv  # [b, t, d/2]
        cos = angles.cos().repeat_interleave(2, dim=-1)[:, None, :, :]  # [b, 1, t, d]
        sin = angles.sin().repeat_interleave(2, dim=-1)[:, None, :, :]

        def turn(u):  # rotate every two: (x0, x1) -> (-x1, x0)
            pairs = u.unflatten(-1, (-1, 2))
            return u * cos + torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2) * sin

        q = turn(self.wq(hidden_states).view(b, t, self.h, self.d).transpose(1, 2))  # [b, h, t, d]
        k = turn(self.wk(hidden_states).view(b, t, self.kv, self.d).transpose(1, 2))  # [b, kv, t, d]
        v = self.wv(hidden_states).view(b, t, self.kv, self.d).transpose(1, 2)
        k, v = k.repeat_interleave(self.h // self.kv, dim=1), v.repeat_interleave(self.h // self.kv, dim=1)
        scale = 1 / math.sqrt(self.width) if self.bug == "scale_width" else None
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)  # [b, h, t, d]
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class SeqPosAttention(nn.Module):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.h, self.d, self.bug = heads, dim // heads, bug
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.out = nn.Linear(dim, dim, bias=True)
        trained(self, 23, shift=0.0)

    def forward(self, x, seq_pos):
        b, t, _ = x.shape
        inv = 1.0 / 10000.0 ** (torch.arange(0, self.d, 2, dtype=torch.float32) / self.d)
        freqs = torch.outer(seq_pos.float(), inv)  # [t, d/2]
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs)[:, None, :]  # [t, 1, d/2]
        q, k, v = self.qkv(x).view(b, t, 3, self.h, self.d).unbind(2)  # [b, t, h, d] each

        def turn(u):
            z = torch.view_as_complex(u.float().reshape(*u.shape[:-1], -1, 2))
            return torch.view_as_real(z * freqs_cis).flatten(-2).type_as(u)

        q, k, v = turn(q).transpose(1, 2), turn(k).transpose(1, 2), v.transpose(1, 2)  # [b, h, t, d]
        seen = seq_pos[:, None] >= seq_pos[None, :]  # [t, t]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.d)
        weights = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
        heads = weights @ v  # [b, h, t, d]
        merged = heads.reshape(b, t, -1) if self.bug == "merge_view" else heads.transpose(1, 2).reshape(b, t, -1)
        return self.out(merged)
