"""RoPE on the input: the hidden states turned by position before the queries' and keys' projections (HF
Wav2Vec2-Conformer's rotary self-attention, its tables as buffers and rotate-half; a functional one turning adjacent
pairs as complex numbers, Meta's view_as_complex idiom; a RoFormer-like rotate-every-two by stack and flatten, its
sinusoid computed in the forward), the values' projection reading the input as it is. The plant: the values
projected from the turned input too, which RoPE never rotates."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from _trace_ref import trained


def _attend(q, k, v, heads):
    """[B, N, D] each: multi-head attention, the heads merged back to [B, N, D]."""
    B, N, D = q.shape
    q, k, v = (t.reshape(B, N, heads, -1).transpose(1, 2) for t in (q, k, v))
    attn = (q @ k.transpose(-1, -2) / math.sqrt(D // heads)).softmax(dim=-1)
    return (attn @ v).transpose(1, 2).reshape(B, N, D)


class ConformerRotary(nn.Module):
    """Wav2Vec2-Conformer-like: `query_key_states` the hidden states viewed per head and rotated (rotate-half, cos
    and sin tables as buffers), `linear_q` and `linear_k` on them, `linear_v` on the hidden states."""

    def __init__(self, hidden=16, heads=2, max_len=32, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        d = hidden // heads
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.einsum("i,j->ij", torch.arange(max_len).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[:, None, :], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[:, None, :], persistent=False)
        self.linear_q, self.linear_k, self.linear_v, self.linear_out = (nn.Linear(hidden, hidden) for _ in range(4))
        trained(self, 17)

    def forward(self, hidden_states):
        B, N, D = hidden_states.shape
        states = hidden_states.view(B, N, self.heads, D // self.heads)
        half = states.shape[-1] // 2
        rotated = torch.cat((-states[..., half:], states[..., :half]), dim=-1)
        query_key_states = (states * self.cos_cached[:N] + rotated * self.sin_cached[:N]).view(B, N, D)
        value_states = query_key_states if self.bug == "values_turned" else hidden_states
        out = _attend(self.linear_q(query_key_states), self.linear_k(query_key_states),
                      self.linear_v(value_states), self.heads)
        return self.linear_out(out)


class ComplexTurned(nn.Module):
    """Functional: the input's adjacent pairs turned as complex numbers by `torch.polar` (Meta's idiom, on the input),
    weights as Parameters through F.linear."""

    def __init__(self, dim=16, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.wq, self.wk, self.wv, self.wo = (nn.Parameter(torch.randn(dim, dim) / math.sqrt(dim)) for _ in range(4))
        self.bv = nn.Parameter(0.1 * torch.randn(dim))
        trained(self, 17)

    def forward(self, x):
        B, N, D = x.shape
        d = D // self.heads
        freqs = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
        cis = torch.polar(torch.ones(N, d // 2), torch.outer(torch.arange(N).float(), freqs))
        xc = torch.view_as_complex(x.float().reshape(B, N, self.heads, d // 2, 2))
        turned = torch.view_as_real(xc * cis[:, None, :]).flatten(2).type_as(x)
        v_in = turned if self.bug == "values_turned" else x
        out = _attend(F.linear(turned, self.wq), F.linear(turned, self.wk), F.linear(v_in, self.wv, self.bv),
                      self.heads)
        return F.linear(out, self.wo)


class RoFormerTurned(nn.Module):
    """RoFormer-like: a sinusoid computed in the forward, each head's features turned two by two (rotate-every-two
    by stack and flatten), on the hidden states before `query` and `key`."""

    def __init__(self, hidden=24, heads=3, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.query, self.key, self.value, self.dense = (nn.Linear(hidden, hidden) for _ in range(4))
        trained(self, 17)

    def forward(self, hidden_states):
        B, N, D = hidden_states.shape
        d = D // self.heads
        position = torch.arange(N, dtype=torch.float32)[:, None]
        inv = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * -(math.log(10000.0) / d))
        sin, cos = torch.sin(position * inv), torch.cos(position * inv)  # [N, d / 2]
        sin_pos = torch.stack([sin, sin], dim=-1).reshape(N, 1, d)
        cos_pos = torch.stack([cos, cos], dim=-1).reshape(N, 1, d)
        h = hidden_states.view(B, N, self.heads, d)
        every_two = torch.stack([-h[..., 1::2], h[..., ::2]], dim=-1).reshape_as(h)
        turned = (h * cos_pos + every_two * sin_pos).reshape(B, N, D)
        v_in = turned if self.bug == "values_turned" else hidden_states
        return self.dense(_attend(self.query(turned), self.key(turned), self.value(v_in), self.heads))
