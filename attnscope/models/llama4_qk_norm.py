"""Llama 4's qk-norm, the one thing its attention adds to MultiHeadAttention: after RoPE, each head's q and k
divided by their root mean square, with no weights (`Llama4TextL2Norm`: `x · rsqrt(mean(x²) + eps)`), unlike
Qwen3's and Gemma 3's RMSNorm with weights before RoPE. Steps `Q_normed`, `K_normed`, then sdpa reads them.
Apart from llama4.py so that reading a Llama 4 head's weights never imports torch."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from attnscope.errors import UsageError
from attnscope.multihead import MultiHeadAttention

if TYPE_CHECKING:
    from attnscope.attention import Names
    from attnscope.spec import AttentionSpec


class Llama4Attention(MultiHeadAttention):
    """MultiHeadAttention with Llama 4's qk-norm: after RoPE, each head's q and k L2-normed (no weights)."""

    def __init__(self, *args: Any, qk_norm_eps: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.qk_norm_eps = qk_norm_eps

    def _heads(self, add: Any, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
               cache: tuple[torch.Tensor, torch.Tensor] | None,
               spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Names]:
        q, k, v, names = super()._heads(add, Q, K, V, cache, spec)
        if self.qk_norm_eps is None:
            return q, k, v, names
        if cache is not None:
            raise UsageError("Llama 4's qk-norm is traced on a whole text, without a KV cache")
        eps = self.qk_norm_eps
        q = add("Q_normed", l2_norm(q, eps), ("n_batch", "n_head", "n_Q", "d_head"),
                f"{names.Q} * rsqrt(mean({names.Q}², dim=-1) + {eps:g}): Llama 4's L2 qk-norm, no weights, after RoPE",
                4 * q.numel())
        k = add("K_normed", l2_norm(k, eps), ("n_batch", self._kv_axis(), "n_K", "d_head"),
                f"{names.K} * rsqrt(mean({names.K}², dim=-1) + {eps:g}): the same norm of the keys", 4 * k.numel())
        return q, k, v, replace(names, Q="Q_normed", K="K_normed")


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`Llama4TextL2Norm`: `x · rsqrt(mean(x²) + eps)` over the last axis."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # [.., d_head]
