"""Rotary position embeddings (RoPE) in the half-split convention of transformers' LLaMA family.

For a head of size d_head, pair i (i < d_head/2) turns at the rate `inv_freq[i] = base^(-2i / d_head)`
(`LlamaRotaryEmbedding.compute_default_rope_parameters`); position p turns it by `p · inv_freq[i]`.
`cos, sin` `[n, d_head]` hold `cat(p · inv_freq, p · inv_freq)`'s cosine and sine, and a query or key
is rotated as `x * cos + rotate_half(x) * sin` (`apply_rotary_pos_emb`), computed in float32 and cast
to the input's dtype, as transformers does.

Half-split pairs coordinate i with coordinate i + d_head/2. The interleaved convention (GPT-J, Meta's
reference `llama/model.py`, which multiplies complex numbers) pairs 2i with 2i + 1; the two give the
same attention once the weights' rows are permuted, which is what transformers' conversion script does.

`llama3` scaling (`modeling_rope_utils._compute_llama3_parameters`) slows the low frequencies down by
`factor` and blends the middle band; no other scaling is computed here, and asking for one is refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError

if TYPE_CHECKING:
    import torch
    from torch import Tensor

SUPPORTED_SCALING = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class Rope:
    """RoPE's settings: `base` (a config's `rope_theta`) and an optional scaling (a config's `rope_scaling`)."""

    base: float = 10000.0
    scaling: Mapping[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.base) and self.base > 1.0):
            raise UsageError(f"RoPE base {self.base:g} must be a finite number above 1 (LLaMA uses 10000 or 500000)")
        kind = self.kind
        if kind not in SUPPORTED_SCALING:
            raise UsageError(f"RoPE scaling {kind!r} is not supported; attnscope computes "
                             f"{' and '.join(SUPPORTED_SCALING)} (transformers' _compute_llama3_parameters)")
        if kind == "llama3":
            missing = [key for key in LLAMA3_KEYS if key not in (self.scaling or {})]
            if missing:
                raise UsageError(f"llama3 RoPE scaling needs {', '.join(missing)} in rope_scaling")

    @property
    def kind(self) -> str:
        if not self.scaling:
            return "default"
        return str(self.scaling.get("rope_type", self.scaling.get("type", "default")))

    def describe(self) -> str:
        return f"base {self.base:g}" + (f", {self.kind} scaling" if self.kind != "default" else "")

    def inv_freq(self, d_head: int) -> Tensor:
        """`[d_head / 2]` float32: how fast each pair of coordinates turns per position."""
        import torch

        check_head_size(d_head)
        inv_freq = 1.0 / (self.base ** (torch.arange(0, d_head, 2, dtype=torch.int64).float() / d_head))
        if self.kind == "llama3":
            inv_freq = _llama3(inv_freq, self.scaling or {})
        return inv_freq

    def cos_sin(self, n_pos: int, d_head: int, dtype: torch.dtype, device: Any = None) -> tuple[Tensor, Tensor]:
        """`cos, sin` `[n_pos, d_head]` for positions 0 .. n_pos - 1, computed in float32, then cast to `dtype`."""
        import torch

        positions = torch.arange(n_pos, device=device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq(d_head).to(device)  # [n_pos, d_head / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [n_pos, d_head]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def check_head_size(d_head: int) -> None:
    if d_head % 2:
        raise UsageError(f"RoPE rotates pairs of coordinates, so d_head must be even; it is {d_head}")


def _llama3(inv_freq: Tensor, scaling: Mapping[str, Any]) -> Tensor:
    """Llama 3.1's frequency scaling, as transformers' `_compute_llama3_parameters` computes it."""
    import torch

    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    if not (factor > 0 and high > low > 0 and old_context > 0):
        raise UsageError("llama3 RoPE scaling needs factor > 0, high_freq_factor > low_freq_factor > 0 and "
                         "original_max_position_embeddings > 0")
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)  # low frequencies: slowed down
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: Tensor) -> Tensor:
    """`[x1, x2] -> [-x2, x1]` over the last axis, halves of equal size."""
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`x * cos + rotate_half(x) * sin`; `cos`, `sin` `[n, d_head]` broadcast over x's leading axes."""
    return x * cos + rotate_half(x) * sin
