"""Styles for tests/test_trace_round30_glmrope.py: attention that takes RoPE's tables as its model's rotary module
makes them, half-split (`cat((freqs, freqs))`), and lays them out interleaved itself before it turns its pairs
(2i, 2i + 1): transformers' GLM, GLM-4 and Helium apply_rotary_pos_emb, `cos[..., : cos.shape[-1] // 2]
.repeat_interleave(2)`, in other code.

- `GlmLikePartial`: GLM's form: `cos, sin = position_embeddings`, each `[B, n, rotary_dim]`, the tables only as wide
  as the share of each head its config's `partial_rotary_factor` (0.5) says; grouped heads laid `[B, n, heads, d]`,
  the tables unsqueezed on axis 2; the first half of each table repeat_interleaved, an interleaved rotate_half over
  the first `cos.shape[-1]` coordinates, the rest passed through.
- `HeliumLikeFull`: Helium's form over the whole head (its `rope_theta` its own), written with pairs: the first half
  of each table (one angle a pair) turns each pair `x.unflatten(-1, (-1, 2))` as a complex multiplication would; a
  fused qkv projection.
- `EinsumApart`: plain functions: `cos` and `sin` apart, `[n, d_head]`, the share of each head read from the
  module's own `rotary_pct` (0.5); 2x2 rotation matrices built from the tables' first halves, applied by einsum.

Plants (`bug=`): `halves` pairs the laid-out tables' coordinates half-split (LLaMA's rotate_half, i with
i + r/2) where they are laid out for (2i, 2i + 1) (GlmLikePartial); `unconverted` turns the pairs interleaved on the
half-split tables as they come, pair i meeting another pair's angle (EinsumApart: its tables apart are laid one way;
the same code on a pair in one parameter is Cohere's, run on interleaved tables); `share` turns only the first half
of each head, by the first angles of the whole head's tables (GPT-NeoX's inv_freq spread over the head while a
share turns: HeliumLikeFull).
"""

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from _trace_ref import trained


def rotate_pairs(x):
    """(x0, x1, x2, x3, ..) -> (-x1, x0, -x3, x2, ..): each pair (2i, 2i + 1) turned a quarter."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class GlmLikeConfig:
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rope_parameters: dict = field(default_factory=lambda: {"rope_theta": 10000.0, "partial_rotary_factor": 0.5})


class GlmLikePartial(nn.Module):
    def __init__(self, config=None, bug=None):
        super().__init__()
        self.config = config or GlmLikeConfig()
        c, self.bug = self.config, bug
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size)
        trained(self, 30)

    def rope(self, x, cos, sin):  # x [B, n, heads, d]; cos, sin [B, n, 1, rotary_dim]
        cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
        r = cos.shape[-1]
        turn = rotate_half if self.bug == "halves" else rotate_pairs
        return torch.cat([x[..., :r] * cos + turn(x[..., :r]) * sin, x[..., r:]], dim=-1)

    def forward(self, hidden_states, position_embeddings):
        B, n, _ = hidden_states.shape
        cos, sin = (t.unsqueeze(2) for t in position_embeddings)
        q = self.rope(self.q_proj(hidden_states).view(B, n, self.heads, self.head_dim), cos, sin)
        k = self.rope(self.k_proj(hidden_states).view(B, n, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(hidden_states).view(B, n, self.kv_heads, self.head_dim)
        group = self.heads // self.kv_heads
        q, k, v = q.transpose(1, 2), k.repeat_interleave(group, 2).transpose(1, 2), v.repeat_interleave(group, 2)
        scores = q @ k.transpose(-1, -2) * self.head_dim ** -0.5
        causal = torch.full((n, n), float("-inf")).triu(1)
        weights = torch.softmax(scores + causal, dim=-1)
        out = weights @ v.transpose(1, 2)
        return self.o_proj(out.transpose(1, 2).reshape(B, n, -1))


class HeliumLikeFull(nn.Module):
    def __init__(self, dim=64, heads=4, bug=None):
        super().__init__()
        self.heads, self.head_dim, self.bug = heads, dim // heads, bug
        self.rope_theta = 10000.0
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        trained(self, 301)

    def turn(self, x, cos, sin):  # x [B, heads, n, d]; cos, sin [B, 1, n, d] laid cat((freqs, freqs))
        r = self.head_dim // 2 if self.bug == "share" else self.head_dim
        c, s = cos[..., : r // 2], sin[..., : r // 2]  # one angle a pair
        pairs = x[..., :r].unflatten(-1, (-1, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        turned = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
        return torch.cat([turned, x[..., r:]], dim=-1)

    def forward(self, x, position_embeddings):
        B, n, dim = x.shape
        cos, sin = position_embeddings
        cos, sin = cos[:, None], sin[:, None]
        q, k, v = self.qkv(x).view(B, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.turn(q, cos, sin), self.turn(k, cos, sin)
        att = (q @ k.transpose(-2, -1)) / self.head_dim ** 0.5
        att = att.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, n, dim))


def rotations(cos, sin):
    """[n, r] tables laid cat((freqs, freqs)) -> [n, r / 2, 2, 2] rotations [[cos, -sin], [sin, cos]] of each pair."""
    c, s = cos[:, : cos.shape[-1] // 2], sin[:, : sin.shape[-1] // 2]
    return torch.stack((torch.stack((c, -s), -1), torch.stack((s, c), -1)), -2)


def apply_rope(x, cos, sin, unconverted=False):
    """x [B, heads, n, d]: its first cos.shape[-1] coordinates turned pair by pair, the rest passed through."""
    r = cos.shape[-1]
    part = x[..., :r]
    if unconverted:  # the tables as they come, on the pairs (2i, 2i + 1)
        turned = torch.einsum("bhnd,nd->bhnd", part, cos) + torch.einsum("bhnd,nd->bhnd", rotate_pairs(part), sin)
    else:
        turned = torch.einsum("npij,bhnpj->bhnpi", rotations(cos, sin), part.unflatten(-1, (-1, 2))).flatten(-2)
    return torch.cat((turned, x[..., r:]), -1)


class EinsumApart(nn.Module):
    def __init__(self, dim=64, heads=4, bug=None):
        super().__init__()
        self.heads, self.head_dim, self.bug = heads, dim // heads, bug
        self.rotary_pct = 0.5
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)
        trained(self, 302)

    def forward(self, x, cos, sin):
        B, n, dim = x.shape
        q, k, v = (torch.einsum("bnd,hed->bhne", x, w.weight.view(self.heads, self.head_dim, dim))
                   for w in (self.wq, self.wk, self.wv))
        cos, sin = cos[:n], sin[:n]
        q = apply_rope(q, cos, sin, self.bug == "unconverted")
        k = apply_rope(k, cos, sin, self.bug == "unconverted")
        scores = torch.einsum("bhqe,bhke->bhqk", q, k) / self.head_dim ** 0.5
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        out = torch.einsum("bhqk,bhke->bqhe", scores.softmax(-1), v)
        return self.wo(out.reshape(B, n, dim))
