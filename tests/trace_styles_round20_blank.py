"""A style of our own that assembles its grouped keys and values in tensors made uninitialised and filled by slices
(as DeepSeek-V2's naive MLA writes `key_states = k_pe.new_empty(...)`, then `key_states[..., :d_nope] = k_nope`),
for tests/test_trace_round20_blank.py. `bug`: '' (correct), 'no_scale' (scores not divided by √d_head), 'tiled'
(query head i reads key head i % n_kv_head, not i // n_rep)."""

from __future__ import annotations

import torch
from torch import nn


class LoopedGroups(nn.Module):
    def __init__(self, d_model: int = 16, n_head: int = 4, n_kv_head: int = 2, bug: str = "") -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.d_head, self.bug = n_head, n_kv_head, d_model // n_head, bug
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, n_kv_head * self.d_head)
        self.v_proj = nn.Linear(d_model, n_kv_head * self.d_head)
        self.o_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.n_head, self.d_head).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.n_kv_head, self.d_head).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.n_kv_head, self.d_head).transpose(1, 2)
        key_states = k.new_empty(b, self.n_head, n, self.d_head)
        value_states = v.new_empty(b, self.n_head, n, self.d_head)
        n_rep = self.n_head // self.n_kv_head
        for i in range(self.n_head):
            group = i % self.n_kv_head if self.bug == "tiled" else i // n_rep
            key_states[:, i] = k[:, group]
            value_states[:, i] = v[:, group]
        scores = q @ key_states.transpose(2, 3)
        if self.bug != "no_scale":
            scores = scores / self.d_head ** 0.5
        out = scores.softmax(dim=-1) @ value_states
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))
