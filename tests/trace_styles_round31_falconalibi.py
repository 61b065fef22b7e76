"""Falcon's order written by hand: ALiBi added to q · kᵀ BEFORE the 1/√d_head scale, `(q · kᵀ + alibi) · scale`, as
transformers' FalconAttention does with `alibi=True` (its `inv_norm_factor`). The scale multiplies the bias too, so
the code adds ALiBi's slopes times the scale: a convention, never `alibi.slopes`. Weights moved off their init.

- FalconOwn: builds its own ALiBi, m_h · (j − i), from the geometric slopes; per-head interleaved fused qkv
  `[n, h, 3, d]`, `(scores + alibi) / math.sqrt(d)`, masked_fill, softmax, `dense`. `bug`: 'scale_twice' (the
  queries scaled first as well), 'slopes_from_0' (2^(-8 h / n) from h = 0), 'slopes_doubled' (twice ALiBi's slopes:
  a factor that is not the scale), 'slopes_scaled_again' (Falcon's order with slopes already divided by √d).
- FalconHanded: its model hands ALiBi in (`alibi` [n_batch·n_head, 1, n_K], BLOOM's m_h · j) and an additive mask;
  `torch.baddbmm(alibi, q, kᵀ)` then `.mul_(inv_norm_factor)` in place, multi-query (one key/value head). `bug`:
  'sign' (the bias subtracted), 'slopes_doubled' (twice the bias handed in), 'scale_twice' (`.mul_(inv_norm_factor)`
  once more: the bias scaled twice too).
- FalconDoubled: transformers' FalconAttention itself, handed twice the bias (wrong slopes, planted): its values are
  broadcast from one head, so no V_rep is ever made, and the step said is the biased scores, never V_rep.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.falcon.modeling_falcon import FalconAttention, FalconConfig


def trained(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


def geometric_slopes(n_head: int, first: int = 1) -> torch.Tensor:
    """2^(-8 h / n_head) for h = first .. first + n_head - 1 (n_head a power of two)."""
    return torch.tensor([2.0 ** (-8 * h / n_head) for h in range(first, first + n_head)])


class FalconOwn(nn.Module):
    def __init__(self, dim=32, heads=4, bug="", scale=None):
        super().__init__()
        self.h, self.d, self.bug = heads, dim // heads, bug
        self.scale = 1 / math.sqrt(self.d) if scale is None else scale  # a scale of its own: --scale says it
        self.query_key_value = nn.Linear(dim, 3 * dim)
        self.dense = nn.Linear(dim, dim)
        slopes = geometric_slopes(heads, 0 if bug == "slopes_from_0" else 1)
        if bug == "slopes_doubled":
            slopes = slopes * 2
        if bug == "slopes_scaled_again":
            slopes = slopes / math.sqrt(self.d)
        self.register_buffer("slopes", slopes, persistent=False)
        trained(self, 31)

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.query_key_value(x).view(b, n, self.h, 3, self.d)
        q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))  # [b, h, n, d]
        if self.bug == "scale_twice":
            q = q / math.sqrt(self.d)
        pos = torch.arange(n)
        alibi = self.slopes[:, None, None] * (pos[None, :] - pos[:, None])  # m_h · (j − i), [h, n, n]
        scores = (q @ k.transpose(-1, -2) + alibi) * self.scale  # Falcon's order: bias, then the scale
        scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        probs = F.softmax(scores, dim=-1)
        return self.dense((probs @ v).transpose(1, 2).reshape(b, n, self.h * self.d))


class FalconHanded(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, bug=""):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.query_key_value = nn.Linear(hidden_size, hidden_size + 2 * self.head_dim, bias=True)
        self.dense = nn.Linear(hidden_size, hidden_size, bias=True)
        trained(self, 32)

    def forward(self, hidden_states, alibi, attention_mask):
        b, n, _ = hidden_states.shape
        fused = self.query_key_value(hidden_states).view(b, n, self.num_heads + 2, self.head_dim)
        q = fused[:, :, :-2].transpose(1, 2).reshape(b * self.num_heads, n, self.head_dim)
        k = fused[:, :, -2].unsqueeze(1).expand(b, self.num_heads, n, self.head_dim)
        k = k.reshape(b * self.num_heads, n, self.head_dim)
        v = fused[:, :, -1]  # [b, n, d]: one key/value head
        bias = -alibi if self.bug == "sign" else alibi * 2 if self.bug == "slopes_doubled" else alibi
        scores = torch.baddbmm(bias, q, k.transpose(1, 2)).mul_(self.inv_norm_factor)  # [b·h, n, n]
        if self.bug == "scale_twice":
            scores = scores.mul_(self.inv_norm_factor)
        scores = scores.view(b, self.num_heads, n, n) + attention_mask
        probs = F.softmax(scores, dim=-1)
        out = (probs @ v[:, None]).flatten(0, 1)  # [b·h, n, d], Falcon's: the heads merged back from there
        out = out.view(b, self.num_heads, n, self.head_dim).permute(0, 2, 1, 3)
        return self.dense(out.reshape(b, n, self.num_heads * self.head_dim))


class FalconDoubled(FalconAttention):
    """transformers' own FalconAttention (alibi=True), handed twice the bias its model builds: the slopes are wrong
    by a factor that is not the scale."""

    def __init__(self, hidden_size=32, num_heads=4):
        super().__init__(FalconConfig(hidden_size=hidden_size, num_attention_heads=num_heads, alibi=True), layer_idx=0)
        trained(self, 33)

    def forward(self, hidden_states, alibi, attention_mask):
        return super().forward(hidden_states, alibi * 2, attention_mask)[0]
