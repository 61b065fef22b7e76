"""Llama4Attention <- MultiHeadAttention: Llama 4's attention module (llama4.py)

Llama 4's qk-norm, the one thing its attention adds to MultiHeadAttention: after RoPE, each head's q and k
divided by their root mean square, with no weights (`Llama4TextL2Norm`: `x · rsqrt(mean(x²) + eps)`), unlike
Qwen3's and Gemma 3's RMSNorm with weights before RoPE. Steps `Q_normed`, `K_normed` (the new tokens' only, with a KV
cache: it holds normed keys), then sdpa reads them.
Apart from llama4.py so that reading a Llama 4 head's weights never imports torch."""

from __future__ import annotations

from typing import Any

import torch

from attnscope.attention.multihead import MultiHeadAttention


class Llama4Attention(MultiHeadAttention):
    """MultiHeadAttention with Llama 4's qk-norm: after RoPE, each head's q and k L2-normed (no weights)."""

    def __init__(self, *args: Any, qk_norm_eps: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.qk_norm_eps = qk_norm_eps

    def _after_rope(self, add: Any, q: torch.Tensor, k: torch.Tensor, names: tuple[str, str],
                    k_axes: tuple[str, str]) -> tuple[torch.Tensor, torch.Tensor, str, str]:
        """The new tokens' q and k normed after RoPE and before the cache joins, as `Llama4TextAttention` norms
        them before `past_key_values.update`: the cached keys are already normed."""
        if self.qk_norm_eps is None:
            return q, k, names[0], names[1]
        eps, (q_name, k_name) = self.qk_norm_eps, names
        q = add("Q_normed", l2_norm(q, eps), ("n_batch", "n_head", "n_Q", "d_head"),
                f"{q_name} * rsqrt(mean({q_name}², dim=-1) + {eps:g}): Llama 4's L2 qk-norm, no weights, after RoPE",
                4 * q.numel())
        k = add("K_normed", l2_norm(k, eps), ("n_batch", *k_axes, "d_head"),
                f"{k_name} * rsqrt(mean({k_name}², dim=-1) + {eps:g}): the same norm of the keys", 4 * k.numel())
        return q, k, "Q_normed", "K_normed"


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`Llama4TextL2Norm`: `x · rsqrt(mean(x²) + eps)` over the last axis."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # [.., d_head]
