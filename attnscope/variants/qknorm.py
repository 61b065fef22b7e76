"""qk-norm: an RMSNorm (or a LayerNorm) of the queries and the keys before RoPE, as today's models keep their logits
in range.

Two placements, as checkpoints have them (`QkNorm.over`), each before RoPE or after it (`after_rope`: nGPT's
`sqk · normalize(q)` on the rotated heads, its learned gain per channel turning with no pair; over the projection,
each position's rotated heads normed at once, OLMo 2's norm moved past the rotation, as code traced may have it; a
norm without weights gives the same numbers either side, a rotation keeping each row's length):
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

The LayerNorm kind (`kind="layer"`) is timm's default: its `Attention(qk_norm=True)` takes `norm_layer=nn.LayerNorm`,
`(x - mean) · rsqrt(var + eps) · w + b` over d_head with a weight and a bias `[d_head]`, eps 1e-5
(`torch.nn.functional.layer_norm`, computed in float32 as nn.LayerNorm's kernels do, cast back).

This module is the norm as the spec asks for it (`QkNorm`: where, eps, the offset, the kind, checked once); the
formula and its op's text are a stage, attention/stages.py's `normalize` (`qk_norm`, `norm_op`), which records steps
`Q_normed`, `K_normed` beside its rotate and tune, so a page's attention reads as stages alone; TransformerLens
calls the same tensors `hook_q_normed` and `hook_k_normed`. No torch here: the spec that carries a `QkNorm` is
built before torch loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from attnscope.errors import UsageError

PLACES = ("head", "proj")
KINDS = ("rms", "layer")  # RMSNorm (Qwen3, OLMo 2, Gemma 3, timm's norm_layer=RmsNorm) or LayerNorm (timm's default)


@dataclass(frozen=True)
class QkNorm:
    """Where the norm of Q and K runs (`over`: "head" or "proj"), its `eps`, whether its weights are offsets from 1
    (Gemma's `(1 + w)`), and its `kind`: "rms" (RMSNorm, a weight) or "layer" (LayerNorm, a weight and a bias)."""

    over: str = "head"
    eps: float = 1e-6
    offset: bool = False
    kind: str = "rms"
    # on the rotated q and k (nGPT's, per head; over the whole projection, every rotated head at once, as OLMo 2's norm
    # moved past the rotation); before RoPE otherwise
    after_rope: bool = False

    def __post_init__(self) -> None:
        if self.over not in PLACES:
            raise UsageError(f"{{qk_norm}} {self.over!r}: use 'head' (RMSNorm of each head over d_head: Qwen3, "
                             "Gemma 3) or 'proj' (over the whole projection before the split: OLMo 2)", "qk_norm")
        eps = self.eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps >= 0):
            raise UsageError(f"{{qk_norm}} eps {eps!r}: the norm's epsilon must be a finite number, 0 or more "
                             "(Qwen3 uses 1e-6)", "qk_norm")
        if self.kind not in KINDS:
            raise UsageError(f"{{qk_norm}} kind {self.kind!r}: use 'rms' (RMSNorm: Qwen3, OLMo 2, Gemma 3) or 'layer' "
                             "(LayerNorm, a bias too: timm's qk_norm=True)", "qk_norm")
        if self.offset and self.kind == "layer":
            raise UsageError("{qk_norm} offset with kind 'layer': the (1 + w) weights are Gemma's RMSNorm; a "
                             "LayerNorm's weight is its own", "qk_norm")

    @property
    def layer(self) -> bool:
        return self.kind == "layer"

    def width(self, heads: int, d_head: int) -> int:
        """The size of the weight (and of the axis the mean runs over): d_head, or heads·d_head."""
        return d_head if self.over == "head" else heads * d_head

    def describe(self) -> str:
        where = "per head over d_head" if self.over == "head" else "over the whole projection, before the split"
        where += ", after RoPE" if self.after_rope else ""
        return f"qk-norm ({'LayerNorm' if self.layer else 'RMSNorm'} {where}{', (1 + w)' if self.offset else ''})"
