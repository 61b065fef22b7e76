"""Styles of our own whose qk-norm is per head with grouped keys (n_kv_head < n_head), for
tests/test_trace_round27_headnorm.py (round 27's StableLM: a held per-head norm that is never called). Weights moved
off their initial values, every norm's weight distinct per head where it is held per head.

- ListPerHead: StableLM's StableLmLayerNormPerHead, a module whose `norms` ModuleList holds one LayerNorm(d_head) a
  head (4 for q, 2 for k), applied over `torch.split(x, 1, dim=1)` and joined by torch.cat; half-split RoPE; GQA by
  repeat_interleave.
- SharedNorm: one nn.RMSNorm(d_head) for q and one for k, shared by every head (Qwen3's q_norm, k_norm); RoPE; GQA.
- RowNorm: one module holding a `[heads, d_head]` gain (4 rows for q, 2 for k), an RMSNorm of each head with its row;
  no RoPE; GQA by expand.

`bug` for each: 'k_unnormed' (the keys' norm held, never called), 'q_unnormed' (the queries' norm held, never
called), 'after_rope' (RowNorm: 'no_scale' instead, it has no RoPE).
"""

from __future__ import annotations

import torch
from torch import nn
from trace_styles_round21_headnorms import rope, trained  # weights moved off init; half-split RoPE


class LayerNormPerHead(nn.Module):
    def __init__(self, dim: int, num_heads: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(dim, eps=eps, bias=False) for _ in range(num_heads)])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        per_head = torch.split(hidden_states, 1, dim=1)
        return torch.cat([norm(h) for norm, h in zip(self.norms, per_head, strict=True)], dim=1)


class RowRMSNorm(nn.Module):
    def __init__(self, heads: int, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, heads, n, d]
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.weight[:, None, :]


class _Grouped(nn.Module):
    """q, k, v, o projections of 32 features, 4 query heads of 8 over 2 key/value heads; the norms are the style's."""

    turns = True  # half-split RoPE on the normed q and k

    def __init__(self, q_norm: nn.Module, k_norm: nn.Module, bug: str, seed: int) -> None:
        super().__init__()
        self.h, self.g, self.d, self.bug = 4, 2, 8, bug
        self.q_proj = nn.Linear(32, 32)
        self.k_proj = nn.Linear(32, 16)
        self.v_proj = nn.Linear(32, 16)
        self.o_proj = nn.Linear(32, 32)
        self.q_layernorm, self.k_layernorm = q_norm, k_norm
        trained(self, seed)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        return (self.q_proj(x).view(b, n, self.h, self.d).transpose(1, 2),
                self.k_proj(x).view(b, n, self.g, self.d).transpose(1, 2),
                self.v_proj(x).view(b, n, self.g, self.d).transpose(1, 2))

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bug != "q_unnormed":
            q = self.q_layernorm(q)
        if self.bug != "k_unnormed":
            k = self.k_layernorm(k)
        return q, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        if self.bug != "after_rope":
            q, k = self.normed(q, k)
        if self.turns:
            q, k = rope(q), rope(k)
        if self.bug == "after_rope":
            q, k = self.normed(q, k)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = self.h // self.g
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scale = 1.0 if self.bug == "no_scale" else self.d ** -0.5
        w = (q @ k.transpose(-1, -2) * scale).softmax(-1)
        return self.o_proj((w @ v).transpose(1, 2).flatten(2))


class ListPerHead(_Grouped):
    def __init__(self, bug: str = "") -> None:
        super().__init__(LayerNormPerHead(8, 4), LayerNormPerHead(8, 2), bug, 27)


class SharedNorm(_Grouped):
    def __init__(self, bug: str = "") -> None:
        super().__init__(nn.RMSNorm(8, eps=1e-6), nn.RMSNorm(8, eps=1e-6), bug, 28)


class RowNorm(_Grouped):
    turns = False  # no RoPE

    def __init__(self, bug: str = "") -> None:
        super().__init__(RowRMSNorm(4, 8), RowRMSNorm(2, 8), bug, 29)
