"""`Seen.check()`'s reference (attnscope.watch): a watched call's attention in float64 from the recorded Q, K and
mask, written apart from watching/patterns.py, as --check's formula is apart from attention/: scores = Q K^T *
scale, softcap, + position_bias, the mask (boolean: True may attend; additive: added), the causal rule
(SDPA's `is_causal`: query i sees keys 0..i; flash's: aligned at the bottom right, with its window), a learned
sink's column joined to the softmax and dropped (GPT-OSS's `eager_attention_forward`).
"""

from __future__ import annotations

from typing import Any

import torch


def reference(Q: torch.Tensor, K: torch.Tensor, call: Any) -> torch.Tensor:
    """`[n_head, n_Q, n_K]` float64 for one batch element: Q `[n_head, n_Q, d]`, K `[n_head, n_K, d]` (one per
    query head), `call` a watching/record.py Call sliced to that element (`mask` `[1 or n_head, n_Q, n_K]` or None)."""
    q, k = Q.double(), K.double()
    logits = torch.einsum("hqd,hkd->hqk", q, k) * call.scale  # [n_head, n_Q, n_K]
    if call.softcap is not None:
        logits = call.softcap * torch.tanh(logits / call.softcap)
    if call.position_bias is not None:
        logits = logits + call.position_bias.double()
    n_Q, n_K = logits.shape[-2:]
    floor = torch.finfo(torch.float64).min
    if call.mask is not None:
        if call.mask.dtype == torch.bool:
            logits = torch.where(call.mask, logits, torch.full_like(logits, floor))
        else:
            logits = (logits + call.mask.double()).clamp(min=floor)
    if call.causal is not None:
        q_pos = torch.arange(n_Q)[:, None] + (n_K - n_Q if call.causal == "bottom-right" else 0)
        k_pos = torch.arange(n_K)[None, :]
        hidden = k_pos > q_pos
        if call.window is not None:
            hidden = hidden | (q_pos - k_pos >= call.window)
        logits = logits.masked_fill(hidden, floor)
    if call.sinks is not None:
        column = call.sinks.double().reshape(-1, 1, 1).expand(-1, n_Q, 1)  # [n_head, n_Q, 1]
        joined = torch.cat([logits, column], dim=-1)
        return torch.exp(joined - joined.amax(-1, keepdim=True)).div(
            torch.exp(joined - joined.amax(-1, keepdim=True)).sum(-1, keepdim=True))[..., :n_K]
    top = logits.amax(-1, keepdim=True)
    return torch.exp(logits - top) / torch.exp(logits - top).sum(-1, keepdim=True)
