"""A pointwise convolution is a projection: `nn.Conv1d(d_in, d_out, 1)` over `[n_batch, d_in, n]` (guided-diffusion's
and the diffusion UNets' `qkv = conv_nd(1, channels, 3 * channels, 1)`, `proj_out`) computes
`W[:, :, 0] @ x + b[:, None]`, the column form's `W @ x`, one token a column. `conv_args` reads such a call (kernel
size 1, stride 1, no padding, no dilation, one group); record.py records it as that projection, its weight
`[d_out, d_in]` and its bias, and linearweights.linears holds such a layer as the Linear it is, so the reference
holds it so. A convolution of any other kind mixes or skips tokens and stays an op of the code's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def conv_args(args: list[Any] | tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any] | None:
    """F.conv1d's (input, weight, bias) where it is a pointwise projection of a `[n_batch, d_in, n]` input (a weight
    `[d_out, d_in, 1]`, stride 1, no padding, dilation 1, one group); None for any other call."""
    given = dict(zip(CONV_ARGS, args, strict=False)) | {k: v for k, v in kwargs.items() if k in CONV_ARGS}
    x, weight = given.get("input"), given.get("weight")
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 3 \
            or weight.shape[-1] != 1 or x.dim() not in (2, 3) or x.shape[-2] != weight.shape[1]:
        return None
    padding = given.get("padding", 0)
    if not all(_ones(given.get(key, 1), 1) for key in ("stride", "dilation")) or given.get("groups", 1) != 1 \
            or not (padding == "valid" or _ones(padding, 0)):
        return None
    bias = given.get("bias")
    return x, weight, bias if isinstance(bias, torch.Tensor) else None


def is_pointwise(m: Any) -> bool:
    """Whether `m` is an nn.Conv1d that projects each token alone: kernel size 1, stride 1, no padding, dilation 1,
    one group (guided-diffusion's `conv_nd(1, channels, 3 * channels, 1)`)."""
    return isinstance(m, nn.Conv1d) and m.kernel_size == (1,) and m.stride == (1,) and m.dilation == (1,) \
        and m.groups == 1 and m.padding in ((0,), "valid") and m.padding_mode == "zeros"


def kernel_width(module: Any) -> int | None:
    """What a module holding pointwise kernels as parameters alone reads (every weight of more than one axis
    `[d_out, d_in, 1]`, handed to F.conv1d): the width most of them read, d_in; None for any other module."""
    from collections import Counter

    kernels = [tuple(p.shape) for p in module.parameters() if p.dim() >= 2]
    if not kernels or any(len(k) != 3 or k[-1] != 1 for k in kernels):
        return None
    return int(Counter(k[1] for k in kernels).most_common(1)[0][0])


def as_matrix(weight: torch.Tensor) -> torch.Tensor:
    """A pointwise kernel `[d_out, d_in, 1]` as the weight a Linear holds, `[d_out, d_in]`."""
    return weight.detach()[..., 0].clone()


def _ones(value: Any, wanted: int) -> bool:
    """A stride, padding or dilation of `wanted` along the one axis (an int, or a one-element tuple or list)."""
    if isinstance(value, (tuple, list)):
        return len(value) == 1 and value[0] == wanted
    return value == wanted
