"""A pointwise convolution is a projection: `nn.Conv1d(d_in, d_out, 1)` over `[n_batch, d_in, n]` (guided-diffusion's
and the diffusion UNets' `qkv = conv_nd(1, channels, 3 * channels, 1)`, `proj_out`) computes
`W[:, :, 0] @ x + b[:, None]`, the column form's `W @ x`, one token a column; `nn.Conv2d(d_in, d_out, 1)` over a
feature map `[n_batch, d_in, n_h, n_w]` (latent-diffusion's and taming-transformers' `AttnBlock`: q, k, v, proj_out)
computes the same at each of its n_h·n_w positions, the map's tokens in raster order. Grouped (SqueezeBERT's
`nn.Conv1d(d, d, 1, groups=4)`), each group of output channels reads its own group of input channels: still each token
alone, the Linear whose weight is block-diagonal, one block a group. A depthwise one (one channel a group) scales
each channel: no projection. `conv_args` reads such a call (kernel size 1, stride 1, no padding, no dilation, groups
of more than one channel); record.py records it as that projection, its weight `[d_out, d_in]` and its bias, and
linearweights.linears holds such a layer as the Linear it is, so the reference holds it so. A convolution of any
other kind mixes or skips tokens and stays an op of the code's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
FUNCS = {"conv1d": 1, "conv2d": 2}  # F.conv1d, F.conv2d: how many spatial axes each reads


def conv_args(args: list[Any] | tuple[Any, ...], kwargs: dict[str, Any],
              spatial: int = 1) -> tuple[Any, Any, Any, int] | None:
    """F.conv1d's (F.conv2d's, `spatial` = 2) (input, weight, bias, groups) where it is a pointwise projection of a
    `[n_batch, d_in, n]` (`[n_batch, d_in, n_h, n_w]`) input: a weight `[d_out, d_in / groups, 1]` (`[.., 1, 1]`),
    stride 1, no padding, dilation 1, groups of more than one channel; None for any other call."""
    given = dict(zip(CONV_ARGS, args, strict=False)) | {k: v for k, v in kwargs.items() if k in CONV_ARGS}
    x, weight, groups = given.get("input"), given.get("weight"), given.get("groups", 1)
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 2 + spatial \
            or any(n != 1 for n in weight.shape[2:]) or x.dim() not in (1 + spatial, 2 + spatial) \
            or not isinstance(groups, int) or groups < 1 or weight.shape[0] % groups \
            or (groups > 1 and weight.shape[1] == 1) \
            or x.shape[-1 - spatial] != weight.shape[1] * groups:
        return None
    padding = given.get("padding", 0)
    if not all(_ones(given.get(key, 1), 1, spatial) for key in ("stride", "dilation")) \
            or not (padding == "valid" or _ones(padding, 0, spatial)):
        return None
    bias = given.get("bias")
    return x, weight, bias if isinstance(bias, torch.Tensor) else None, groups


def is_pointwise(m: Any) -> bool:
    """Whether `m` is an nn.Conv1d or nn.Conv2d that projects each token alone: kernel size 1, stride 1, no padding,
    dilation 1, groups of more than one channel (guided-diffusion's `conv_nd(1, channels, 3 * channels, 1)`,
    latent-diffusion's `Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)`, SqueezeBERT's
    `groups=4`)."""
    if not isinstance(m, (nn.Conv1d, nn.Conv2d)):
        return False
    ones, zeros = (1,) * len(m.kernel_size), (0,) * len(m.kernel_size)
    return m.kernel_size == ones and m.stride == ones and m.dilation == ones \
        and (m.groups == 1 or m.in_channels > m.groups) and m.padding in (zeros, "valid") and m.padding_mode == "zeros"


def on_maps(module: Any) -> bool:
    """Whether the module projects with pointwise nn.Conv2d layers (or holds only [d_out, d_in, 1, 1] kernels): it
    reads feature maps, `[n_batch, d_feat, n_h, n_w]`."""
    if any(isinstance(m, nn.Conv2d) and is_pointwise(m) for m in module.modules()):
        return True
    kernels = [tuple(p.shape) for p in module.parameters() if p.dim() >= 2]
    return bool(kernels) and all(len(k) == 4 and k[2:] == (1, 1) for k in kernels)


def kernel_width(module: Any) -> int | None:
    """What a module holding pointwise kernels as parameters alone reads (every weight of more than one axis
    `[d_out, d_in, 1]` or `[d_out, d_in, 1, 1]`, handed to F.conv1d or F.conv2d): the width most of them read, d_in;
    None for any other module."""
    from collections import Counter

    kernels = [tuple(p.shape) for p in module.parameters() if p.dim() >= 2]
    if not kernels or any(len(k) not in (3, 4) or any(n != 1 for n in k[2:]) for k in kernels):
        return None
    return int(Counter(k[1] for k in kernels).most_common(1)[0][0])


def as_matrix(weight: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """A pointwise kernel `[d_out, d_in / groups, 1]` (`[.., 1, 1]`) as the weight a Linear holds, `[d_out, d_in]`:
    block-diagonal where grouped (F.conv1d's groups: output channels g·d_out/groups read input channels
    g·d_in/groups on, each group its own), zero between the blocks."""
    kernel = weight.detach().flatten(1)
    if groups == 1:
        return kernel.clone()
    out = kernel.shape[0] // groups
    return torch.block_diag(*(kernel[g * out:(g + 1) * out] for g in range(groups)))


def _ones(value: Any, wanted: int, spatial: int = 1) -> bool:
    """A stride, padding or dilation of `wanted` along every spatial axis (an int, or a tuple or list of one a
    spatial axis)."""
    if isinstance(value, (tuple, list)):
        return len(value) == spatial and all(v == wanted for v in value)
    return value == wanted
