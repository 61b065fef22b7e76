"""The independent reference the trace tests hold a user's module against: `torch.nn.MultiheadAttention` holding
the module's own four Linear layers (its in_proj is q, k and v stacked, as PyTorch keeps it; biases where the
layers have them)."""

from __future__ import annotations

import torch


def holding(q: torch.nn.Linear, k: torch.nn.Linear, v: torch.nn.Linear, o: torch.nn.Linear,
            n_head: int) -> torch.nn.MultiheadAttention:
    bias = q.bias is not None
    mha = torch.nn.MultiheadAttention(q.in_features, n_head, bias=bias, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([q.weight, k.weight, v.weight]))  # [3·d_feat, d_feat]
        mha.out_proj.weight.copy_(o.weight)
        if bias:
            mha.in_proj_bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
            mha.out_proj.bias.copy_(o.bias)
    return mha
