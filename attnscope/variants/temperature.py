"""Llama 4's attention temperature tuning: on its NoPE layers each query is scaled by a factor that grows with
its position, so attention over very long contexts stays sharp (transformers' `Llama4TextAttention.forward`,
after "Scalable-Softmax", arXiv 2501.19399):

    attn_scales[i] = log1p(floor((p_i + 1) / floor_scale)) · attn_scale + 1,   Q_tuned = Q · attn_scales[i]

with p_i the query's position (i after any cached positions). The factor is exactly 1 for the first
floor_scale − 1 positions (Llama 4: floor_scale 8192, attn_scale 0.1), so a short text shows it only with a
small floor_scale. Steps: `attn_scales` `[n_Q]` and `Q_tuned` (Q's shape), after RoPE where a layer has it.
`shift` is the 1 added to the position: Mistral 4's `get_llama_4_attn_scale` adds none, `log(1 + floor(p /
original_max_position_embeddings)) · llama_4_scaling_beta + 1` (shift 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class TemperatureTuning:
    """`floor_scale` and `attn_scale` as Llama4TextConfig names them (defaults: Llama 4's)."""

    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    shift: int = 1  # added to the position before the floor (Llama 4: 1; Mistral 4: 0)

    def __post_init__(self) -> None:
        floor = self.floor_scale
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not (math.isfinite(floor) and floor > 0):
            raise UsageError(f"{{floor_scale}} {floor!r}: the positions per step of the query's temperature must be "
                             "a positive number (Llama 4 uses 8192)", "floor_scale")
        scale = self.attn_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise UsageError(f"{{attn_scale}} {scale!r}: the temperature's strength must be a finite number "
                             "(Llama 4 uses 0.1)", "attn_scale")

    def scales(self, start: int, n_Q: int, device: Any = None) -> Tensor:
        """`[n_Q]` float32: the factor of queries at positions start .. start + n_Q − 1, computed as
        transformers does (float32 positions, `torch.log1p(torch.floor(...))`)."""
        import torch

        positions = torch.arange(n_Q, device=device) + start  # [n_Q]
        return torch.log1p(torch.floor((positions.float() + self.shift) / self.floor_scale)) * self.attn_scale + 1.0

    def op(self, start: int) -> str:
        """The op of the `attn_scales` step."""
        position = "i" if start == 0 else f"(i + {start})"
        position = f"({position} + {self.shift})" if self.shift else position
        return (f"log1p(floor({position} / {self.floor_scale:g})) * {self.attn_scale:g} + 1 "
                "(Llama 4's temperature tuning, its NoPE layers)")

    def describe(self) -> str:
        shift = "" if self.shift == 1 else f", floor((i + {self.shift}) / floor_scale)" if self.shift else \
            ", floor(i / floor_scale): the position not shifted"
        return f"temperature tuning (floor_scale {self.floor_scale:g}, attn_scale {self.attn_scale:g}{shift})"
