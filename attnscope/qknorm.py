"""qk-norm: an RMSNorm of the queries and the keys before RoPE, as today's models keep their logits in range.

Two placements, as checkpoints have them (`QkNorm.over`):
- `"head"` (Qwen3, Qwen3-MoE, Gemma 3): after the split into heads, over each head's own d_head coordinates,
  with one learned weight `[d_head]` that every head shares (transformers' `Qwen3Attention`:
  `q_norm = Qwen3RMSNorm(head_dim)`, applied to `q_proj(x).view(..., -1, head_dim)`).
- `"proj"` (OLMo 2): before the split, over the whole projection, `n_head·d_head` coordinates for the queries
  and `n_kv_head·d_head` for the keys, so one mean runs across every head, with a weight as wide
  (`Olmo2Attention`: `q_norm = Olmo2RMSNorm(num_attention_heads * head_dim)`, applied to `q_proj(x)`).

The formula, `x · rsqrt(mean(x², over the normed axis) + eps) · w`, is computed in float32 and cast back to the
input's dtype (`Olmo2RMSNorm`, `Gemma3RMSNorm`). Gemma stores its norm weights as offsets from 1, so its form
multiplies by `(1 + w)` (`offset=True`, `Gemma3RMSNorm`). `sdpa` has no weights: its qk-norm is the unit-weight
RMSNorm over d_K.

Steps `Q_normed`, `K_normed` (recorded by attention.normalize, beside attention.rotate and attention.tune);
TransformerLens calls the same tensors `hook_q_normed` and `hook_k_normed`.
torch is imported inside the functions: the spec that carries a `QkNorm` is built before torch loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from torch import Tensor

PLACES = ("head", "proj")


@dataclass(frozen=True)
class QkNorm:
    """Where the RMSNorm of Q and K runs (`over`: "head" or "proj"), its `eps`, and whether its weights are
    offsets from 1 (Gemma's `(1 + w)`)."""

    over: str = "head"
    eps: float = 1e-6
    offset: bool = False

    def __post_init__(self) -> None:
        if self.over not in PLACES:
            raise UsageError(f"{{qk_norm}} {self.over!r}: use 'head' (RMSNorm of each head over d_head: Qwen3, "
                             "Gemma 3) or 'proj' (over the whole projection before the split: OLMo 2)", "qk_norm")
        eps = self.eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps >= 0):
            raise UsageError(f"{{qk_norm}} eps {eps!r}: the norm's epsilon must be a finite number, 0 or more "
                             "(Qwen3 uses 1e-6)", "qk_norm")

    def width(self, heads: int, d_head: int) -> int:
        """The size of the weight (and of the axis the mean runs over): d_head, or heads·d_head."""
        return d_head if self.over == "head" else heads * d_head

    def describe(self) -> str:
        where = "per head over d_head" if self.over == "head" else "over the whole projection, before the split"
        return f"qk-norm (RMSNorm {where}{', (1 + w)' if self.offset else ''})"

    def op(self, source: str, axis: str, weight: str | None) -> str:
        """The step's op: the formula, and over which axis (the head's or the projection's)."""
        scaled = "" if weight is None else (f" * (1 + {weight})" if self.offset else f" * {weight}")
        where = {"head": f"RMSNorm of each head over {axis}",
                 "proj": f"RMSNorm over the whole projection ({axis}), before the split"}[self.over]
        unit = ", unit weight" if weight is None else ""
        return f"{source} * rsqrt(mean({source}², dim=-1) + {self.eps:g}){scaled}: {where}{unit}"


def rms_norm(x: Tensor, weight: Tensor | None, norm: QkNorm) -> Tensor:
    """`x · rsqrt(mean(x², -1) + eps) · w` (or `· (1 + w)`) in float32, cast back to x's dtype."""
    import torch

    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)  # [.., width]
    if weight is not None:
        normed = normed * (1.0 + weight.float() if norm.offset else weight.float())
    return normed.to(x.dtype)
