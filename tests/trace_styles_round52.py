"""Two styles of held-out round 52's findings, written afresh for tests/test_trace_round52.py.

- `LoraAttention`: peft-like low-rank adapters on q, k and v (`k_proj(x) + k_lora_B(k_lora_A(x)) * scaling`), causal.
  `bug="values_from_keys"` makes the values with the keys' projection and adapter (a copied line): the adapter's
  down-projection then runs twice, which trace read as multi-head latent attention and refused, and v's adapter
  never runs, which left no reference.
- `InputRotaryAttention`: RoPE on the hidden states before the query and key projections (Wav2Vec2-Conformer's
  rotary), the values' projection reading the hidden states; a key padding mask. `bug="inputs_swapped"` feeds the
  keys' projection the hidden states and the values' the rotated ones.
"""

import math

import torch
from torch import nn


class LoraAttention(nn.Module):
    def __init__(self, d_model=32, n_heads=4, rank=4, alpha=8, bug=None):
        super().__init__()
        self.h, self.bug, self.scaling = n_heads, bug, alpha / rank
        for role in "qkv":
            setattr(self, f"{role}_proj", nn.Linear(d_model, d_model))
            setattr(self, f"{role}_lora_A", nn.Linear(d_model, rank, bias=False))
            setattr(self, f"{role}_lora_B", nn.Linear(rank, d_model, bias=False))
        self.o_proj = nn.Linear(d_model, d_model)

    def _projected(self, role, x):
        base, down, up = (getattr(self, f"{role}_{n}") for n in ("proj", "lora_A", "lora_B"))
        return base(x) + up(down(x)) * self.scaling

    def forward(self, x):
        b, n, d = x.shape
        q, k = self._projected("q", x), self._projected("k", x)
        v = self._projected("k" if self.bug == "values_from_keys" else "v", x)
        q, k, v = (t.view(b, n, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.h)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = scores.softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, n, d))


def rotated_inputs(x, n_heads, base=10000.0):
    """RoPE (half-split) of the hidden states [b, n, d], each head's slice of d turned by the token's position."""
    b, n, d = x.shape
    d_head = d // n_heads
    inv = 1.0 / base ** (torch.arange(0, d_head, 2, dtype=torch.float32) / d_head)
    angles = torch.outer(torch.arange(n, dtype=torch.float32), inv)
    cos, sin = torch.cat((angles, angles), -1).cos().to(x.dtype), torch.cat((angles, angles), -1).sin().to(x.dtype)
    heads = x.view(b, n, n_heads, d_head)
    half = torch.cat((-heads[..., d_head // 2:], heads[..., : d_head // 2]), -1)
    return (heads * cos[None, :, None] + half * sin[None, :, None]).reshape(b, n, d)


class InputRotaryAttention(nn.Module):
    def __init__(self, d_model=32, n_heads=4, bug=None):
        super().__init__()
        self.h, self.bug = n_heads, bug
        self.linear_q = nn.Linear(d_model, d_model)
        self.linear_k = nn.Linear(d_model, d_model)
        self.linear_v = nn.Linear(d_model, d_model)
        self.linear_out = nn.Linear(d_model, d_model)

    def forward(self, hidden_states, attention_mask=None):
        b, n, d = hidden_states.shape
        turned = rotated_inputs(hidden_states, self.h)
        q = self.linear_q(turned)
        k = self.linear_k(hidden_states if self.bug == "inputs_swapped" else turned)
        v = self.linear_v(turned if self.bug == "inputs_swapped" else hidden_states)
        q, k, v = (t.view(b, n, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.h)
        if attention_mask is not None:  # [b, n] of 1 = may attend
            scores = scores + (1.0 - attention_mask[:, None, None, :].to(scores.dtype)) * torch.finfo(scores.dtype).min
        out = scores.softmax(-1) @ v
        return self.linear_out(out.transpose(1, 2).reshape(b, n, d))
