"""Styles for tests/test_trace_round29_ropetables.py: attention that takes RoPE's tables as a forward argument,
`position_embeddings`, made by a rotary module outside it, in the forms transformers' own models hand them.

- `SinFirstPartial`: GPT-J's and CodeGen's form: `sin, cos = position_embeddings` (sin first), each
  `[B, n, rotary_dim / 2]`, which the code expands itself (`repeat_interleave(.., 2, 3)`) and turns interleaved
  (rotate_every_two) over the first rotary_dim coordinates of each head, the rest passed through.
- `InterleavedFull`: Cohere's form: `cos, sin`, each `[B, n, d_head]` laid `repeat_interleave(freqs, 2)`, turned by
  a rotate_half of `x[..., ::2]` and `x[..., 1::2]`.
- `CatPartial`: LLaMA's half-split tables, `cat((freqs, freqs))`, `[B, n, rotary_dim]`, applied to the first
  rotary_dim coordinates of each head only (StableLM's and Persimmon's partial rotary).

Plants (`bug=`): `rotate_half` turns SinFirstPartial's interleaved tables half-split (its rotation pairs otherwise
than its own expansion lays them); `rope_on_values` turns the values too; `no_scale` leaves the scores unscaled.
"""

import torch
import torch.nn as nn
from _trace_ref import trained


def rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class _Heads(nn.Module):
    def __init__(self, dim, heads, seed, bug):
        super().__init__()
        self.heads, self.head_dim, self.bug = heads, dim // heads, bug
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        trained(self, seed)

    def split(self, x, proj):  # [B, n, heads, head_dim]
        return proj(x).view(*x.shape[:2], self.heads, self.head_dim)

    def attend(self, q, k, v):  # q, k, v [B, heads, n, head_dim]; a causal mask of the code's own
        n = q.shape[-2]
        scores = q @ k.transpose(-1, -2)
        if self.bug != "no_scale":
            scores = scores / self.head_dim ** 0.5
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return self.out_proj(out.transpose(1, 2).reshape(q.shape[0], n, -1))


class SinFirstPartial(_Heads):
    def __init__(self, dim=64, heads=4, rotary_dim=8, bug=None):
        super().__init__(dim, heads, 29, bug)
        self.rotary_dim = rotary_dim

    def rotate(self, x, sin, cos):
        sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
        cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
        turn = rotate_half if self.bug == "rotate_half" else rotate_every_two
        return x * cos + turn(x) * sin

    def forward(self, hidden_states, position_embeddings):
        sin, cos = position_embeddings
        q, k, v = (self.split(hidden_states, p) for p in (self.q_proj, self.k_proj, self.v_proj))
        r = self.rotary_dim
        q = torch.cat([self.rotate(q[..., :r], sin, cos), q[..., r:]], dim=-1)
        k = torch.cat([self.rotate(k[..., :r], sin, cos), k[..., r:]], dim=-1)
        if self.bug == "rope_on_values":
            v = torch.cat([self.rotate(v[..., :r], sin, cos), v[..., r:]], dim=-1)
        return self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


class InterleavedFull(_Heads):
    def __init__(self, dim=64, heads=4, bug=None):
        super().__init__(dim, heads, 291, bug)

    def forward(self, hidden_states, position_embeddings):
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k, v = (self.split(hidden_states, p).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = q * cos + rotate_every_two(q) * sin
        k = k * cos + rotate_every_two(k) * sin
        if self.bug == "rope_on_values":
            v = v * cos + rotate_every_two(v) * sin
        return self.attend(q, k, v)


class CatPartial(_Heads):
    def __init__(self, dim=64, heads=4, rotary_dim=8, bug=None):
        super().__init__(dim, heads, 292, bug)
        self.rotary_dim = rotary_dim

    def forward(self, hidden_states, position_embeddings):
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k, v = (self.split(hidden_states, p).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        r = self.rotary_dim
        q_rot, q_pass = q[..., :r], q[..., r:]
        k_rot, k_pass = k[..., :r], k[..., r:]
        q = torch.cat([q_rot * cos + rotate_half(q_rot) * sin, q_pass], dim=-1)
        k = torch.cat([k_rot * cos + rotate_half(k_rot) * sin, k_pass], dim=-1)
        if self.bug == "rope_on_values":
            v = torch.cat([v[..., :r] * cos + rotate_half(v[..., :r]) * sin, v[..., r:]], dim=-1)
        return self.attend(q, k, v)
