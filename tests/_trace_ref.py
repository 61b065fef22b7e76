"""What the trace rounds' styles and tests share (round 25 on): modules moved off their initial weights as a trained
model's are, and the float64 reference their correct styles are checked against, F.scaled_dot_product_attention
over heads split from [B, N, heads·d] projections. A styles file imports it by name: trace puts the file's folder
on sys.path while the code loads (usertrace/load.py), as pytest does for the tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def trained(module: torch.nn.Module, seed: int, spread: float = 0.05, shift: float = 0.01) -> torch.nn.Module:
    """`module` with every parameter moved off its initial value by `spread` · N(0, 1) + `shift` (a generator seeded
    `seed`): no norm weight left at 1, no bias at 0. Returned, changed in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(spread * torch.randn(p.shape, generator=g) + shift)
    return module


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, mask: torch.Tensor | None = None, *,
         scale: float | None = None, causal: bool = False) -> torch.Tensor:
    """[B, N, heads·d] each (N_q and N_k may differ): F.scaled_dot_product_attention of the heads split head-major,
    with `mask` (boolean, True = may attend, or a float bias) or the causal rule, merged back to [B, N_q, heads·d].
    Called on float64 tensors it is the tests' reference."""
    B, N = q.shape[0], q.shape[1]
    q, k, v = (t.reshape(B, t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return out.transpose(1, 2).reshape(B, N, -1)
