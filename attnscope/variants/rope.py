"""Rotary position embeddings (RoPE), computed as transformers computes them.

One `Rope` value says everything: the base (`rope_theta`), the type and its parameters (`rope_parameters` in
transformers 5, `rope_scaling` in 4.4x: default, linear, dynamic, yarn, longrope, llama3, proportional; the
formulas are in rope_scaling.py), the fraction of each head that turns (`partial_rotary_factor`) and the pairing.
`Rope.from_config(config)` reads it from a config.json in either form (rope_config.py).

For a head of size d_head, the first `dim = int(partial_rotary_factor · d_head)` coordinates rotate, as pairs;
pair i turns at `inv_freq[i]` (`base^(-2i/dim)` unscaled) and position p turns it by `p · inv_freq[i]`. The other
coordinates pass through unchanged (Phi-3's and GPT-NeoX's `q_rot, q_pass = q[..., :dim], q[..., dim:]`).
cos and sin `[n, dim]` are computed in float32, multiplied by the type's attention scaling (yarn's and
longrope's `attention_factor`), then cast to the input's dtype, as `LlamaRotaryEmbedding.forward` does.

The pairing:
- half-split (transformers' LLaMA family, `rotate_half`): coordinate i pairs with i + dim/2; cos and sin hold
  `cat(p · inv_freq, p · inv_freq)`; `x_rot = x * cos + rotate_half(x) * sin`.
- interleaved (GPT-J's `rotate_every_two`, Llama 4's `view_as_complex(x.reshape(..., -1, 2))`, Meta's reference
  `llama/model.py`): coordinate 2i pairs with 2i + 1; cos and sin hold each angle twice in a row.
The two give the same attention once the rows of W_q and W_k are permuted, which is what transformers'
conversion scripts do; a checkpoint is written for one of them. DeepSeek-V3's `rope_interleave` reads
interleaved pairs but writes the result half-split: the half-split form applied to `cat(x[..., 0::2],
x[..., 1::2])`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.variants import rope_scaling

if TYPE_CHECKING:
    import torch
    from torch import Tensor

PAIRINGS = ("half-split", "interleaved")
SUPPORTED_SCALING = rope_scaling.TYPES


@dataclass(frozen=True)
class Rope:
    """RoPE's settings.

    `base`: a config's `rope_theta`. `scaling`: its `rope_parameters` (or 4.4x `rope_scaling`) dict, whose
    `rope_type` (or `type`) names the type, None for the default. `partial_rotary_factor`: the fraction of each
    head that rotates, None to take the dict's (else 1). `pairing`: "half-split" or "interleaved".
    `max_position_embeddings`: the config's, which `dynamic` rescales beyond and which yarn and longrope fall
    back on for `original_max_position_embeddings` and `factor`. `source` names the dict in error messages.
    """

    base: float = 10000.0
    scaling: Mapping[str, Any] | None = field(default=None, compare=False)
    partial_rotary_factor: float | None = field(default=None, compare=False)
    pairing: str = "half-split"
    max_position_embeddings: int | None = None
    source: str = field(default="rope_parameters", compare=False, repr=False)
    # What two Ropes are compared by: the type, the fraction and the parameters as read, so that a 4.4x config
    # and its 5.x form (`type` vs `rope_type`, defaults written out or not) give equal Ropes.
    _kind: str = field(init=False, repr=False)
    _fraction: float = field(init=False, repr=False)
    _values: Mapping[str, Any] = field(init=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        base = self.base
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not (math.isfinite(base) and base > 1.0):
            raise UsageError(f"RoPE base {base!r} ({self.source}.rope_theta) must be a finite number above 1 "
                             "(LLaMA uses 10000 or 500000)")
        if self.scaling is not None and not isinstance(self.scaling, Mapping):
            raise UsageError(f"{self.source} is {self.scaling!r}; it must be a dict such as "
                             "{'rope_type': 'linear', 'factor': 2.0}")
        if self.pairing not in PAIRINGS:
            raise UsageError(f"RoPE pairing {self.pairing!r} is not one of {', '.join(PAIRINGS)}")
        if self.max_position_embeddings is not None:
            rope_scaling.whole(self.max_position_embeddings, "max_position_embeddings")
        fraction = self.fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise UsageError(f"{self.source}.partial_rotary_factor is {fraction!r}; it must be a number in (0, 1], "
                             "the fraction of each head that rotates")
        kind = rope_scaling.check_kind(self.kind, self.source)
        values = rope_scaling.parse(kind, self.scaling or {}, self.source, self.max_position_embeddings)
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_fraction", float(fraction))
        object.__setattr__(self, "_values", values)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], layer_type: str | None = None,
                    head_dim: int | None = None) -> Rope | None:
        """The RoPE of a config.json's layers (of `layer_type` where the config gives each type its own, as
        Gemma 3 does), read as transformers reads either form; None where that layer type has no RoPE.
        `head_dim` (default: the config's, or hidden_size / num_attention_heads) is checked against the
        fraction and longrope's factor lists."""
        from attnscope.variants import rope_config

        arguments = rope_config.rope_arguments(config, layer_type, head_dim)
        if arguments is None:
            return None
        rope = cls(**arguments)
        size = rope_config.head_dim(config) if head_dim is None else head_dim
        if size is not None:
            rope.check(size)
        return rope

    @property
    def kind(self) -> str:
        """The type: `rope_type`, or 4.4x's `type`, else "default"."""
        if not self.scaling:
            return "default"
        return self.scaling.get("rope_type", self.scaling.get("type", "default"))  # type: ignore[no-any-return]

    @property
    def fraction(self) -> float:
        """`partial_rotary_factor`: the share of each head that rotates."""
        if self.partial_rotary_factor is not None:
            return self.partial_rotary_factor
        given = (self.scaling or {}).get("partial_rotary_factor")
        return 1.0 if given is None else given  # type: ignore[no-any-return]

    @property
    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by: yarn's and longrope's attention factor, else 1."""
        return rope_scaling.attention_scaling(self.kind, self._values, self.max_position_embeddings)

    def describe(self) -> str:
        parts = [f"base {self.base:g}"]
        if self.kind != "default":
            parts.append(f"{self.kind} scaling")
        if self.fraction != 1:
            parts.append(f"partial {self.fraction:g}")
        if self.pairing != "half-split":
            parts.append(self.pairing)
        return ", ".join(parts)

    def rotary_dim(self, d_head: int) -> int:
        """How many of a head's d_head coordinates rotate: `int(partial_rotary_factor · d_head)`, rounded up to
        a whole pair as transformers' `arange(0, dim, 2)` does (the whole head for proportional)."""
        if self.kind == "proportional":
            check_head_size(d_head)
            return d_head
        dim = int(d_head * self.fraction)
        if d_head == 0:
            return 0
        if dim < 1:
            raise UsageError(f"{self.source}.partial_rotary_factor {self.fraction:g} of d_head {d_head} rotates no "
                             "coordinate; raise it")
        width = 2 * math.ceil(dim / 2)
        if width > d_head:
            check_head_size(d_head)
        if self.kind == "dynamic" and dim <= 2:
            raise UsageError(f"dynamic RoPE rescales by (d/(d−2)); it needs more than 2 rotated coordinates, and "
                             f"partial_rotary_factor {self.fraction:g} of d_head {d_head} rotates {dim}")
        if self.kind == "yarn" and dim % 2:
            raise UsageError(f"yarn RoPE needs an even number of rotated coordinates; partial_rotary_factor "
                             f"{self.fraction:g} of d_head {d_head} rotates {dim}")
        return width

    def check(self, d_head: int) -> None:
        """Refuse, in one line, a head this RoPE cannot rotate (odd size, longrope lists of the wrong length)."""
        pairs = self.rotary_dim(d_head) // 2
        for key in ("short_factor", "long_factor") if self.kind == "longrope" else ():
            factors = self._values.get(key)
            if factors is not None and len(factors) != pairs:
                raise UsageError(f"{self.source}.{key} has {len(factors)} numbers; a head of {d_head} rotating "
                                 f"{2 * pairs} coordinates needs {pairs}, one per pair")

    def inv_freq(self, d_head: int, seq_len: int | None = None) -> Tensor:
        """`[rotary_dim / 2]` float32: how fast each rotated pair turns per position, for a forward over
        positions 0 .. seq_len − 1 (dynamic and longrope depend on it; None: as a module starts)."""
        self.check(d_head)
        return rope_scaling.frequencies(self.kind, self._values, self.base, d_head, self.fraction, seq_len,
                                        self.max_position_embeddings)

    def cos_sin(self, n_pos: int, d_head: int, dtype: torch.dtype, device: Any = None,
                start: int = 0) -> tuple[Tensor, Tensor]:
        """`cos, sin` `[n_pos − start, rotary_dim]` for positions start .. n_pos − 1 of a forward over positions
        up to n_pos − 1 (a negative `start`: queries before key 0, lower-right with more queries than keys),
        computed in float32, times the attention scaling, then cast to `dtype`; laid out for the pairing."""
        import torch

        positions = torch.arange(start, n_pos, device=device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq(d_head, n_pos).to(device)  # [n_pos, rotary_dim / 2]
        if self.pairing == "half-split":
            emb = torch.cat((freqs, freqs), dim=-1)  # [n_pos, rotary_dim]
        else:
            emb = freqs.repeat_interleave(2, dim=-1)  # [n_pos, rotary_dim]
        scale = self.attention_scaling
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos.to(dtype), sin.to(dtype)

    def table_op(self, which: str, d_name: str, d_head: int, n_pos: int, first: int = 0) -> str:
        """The op of the `cos` or `sin` step: the type and its parameters, the attention scaling, and the
        positions where the table starts before 0 (`first`)."""
        width = self.rotary_dim(d_head)
        dim_name = d_name if width == d_head else "d_rot"
        freqs = rope_scaling.describe(self.kind, self._values, self.base, width, dim_name, n_pos,
                                      self.max_position_embeddings, self.fraction)
        scale = self.attention_scaling
        times = f" · {scale:.6g} (attention_scaling)" if scale != 1.0 else ""
        layout = "" if self.pairing == "half-split" else ", each angle twice (interleaved)"
        span = f", positions {first} .. {n_pos - 1}" if first else ""
        return f"{which}(position · inv_freq){times}, inv_freq = {freqs}{layout}{span}"

    def rotate_op(self, src: str, part: str, d_head: int) -> str:
        """The op of `Q_rot`/`K_rot`: what rotates, with which pairing, and what passes through."""
        width = self.rotary_dim(d_head)
        turn = "rotate_half" if self.pairing == "half-split" else "rotate_every_two"
        x = src if width == d_head else f"{src}[..., :{width}]"
        rotated = f"{x} * cos{part} + {turn}({x}) * sin{part}"
        if width == d_head:
            return f"{rotated}, {self.pairing}"
        return (f"cat({rotated}, {src}[..., {width}:]): {x} rotated {self.pairing}, {src}[..., {width}:] passes "
                f"(partial_rotary_factor {self.fraction:g})")


def check_head_size(d_head: int) -> None:
    if d_head % 2:
        raise UsageError(f"RoPE rotates pairs of coordinates, so d_head must be even; it is {d_head}")


def rotate_half(x: Tensor) -> Tensor:
    """`[x1, x2] -> [-x2, x1]` over the last axis, halves of equal size (LLaMA's)."""
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_every_two(x: Tensor) -> Tensor:
    """`[x0, x1, x2, x3, ..] -> [-x1, x0, -x3, x2, ..]` over the last axis (GPT-J's)."""
    import torch

    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Half-split: `x * cos + rotate_half(x) * sin` on x's first `cos.shape[-1]` coordinates, the rest passed
    through; `cos`, `sin` `[n, rotary_dim]` broadcast over x's leading axes (transformers' Phi-3/GPT-NeoX
    `apply_rotary_pos_emb`, LLaMA's when the whole head rotates)."""
    return _partial(x, cos, sin, rotate_half)


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Interleaved: `x * cos + rotate_every_two(x) * sin` on x's first `cos.shape[-1]` coordinates (GPT-J's
    `apply_rotary_pos_emb`; Llama 4's complex product written in reals)."""
    return _partial(x, cos, sin, rotate_every_two)


def _partial(x: Tensor, cos: Tensor, sin: Tensor, turn: Any) -> Tensor:
    import torch

    width = cos.shape[-1]
    if width == x.shape[-1]:
        return x * cos + turn(x) * sin
    x_rot, x_pass = x[..., :width], x[..., width:]
    return torch.cat([x_rot * cos + turn(x_rot) * sin, x_pass], dim=-1)
