"""Attention masks, in one convention: boolean, True = "may attend", as `F.scaled_dot_product_attention`.

A float mask is added to the scores instead (0 keeps a score, -inf removes it). Integer 0/1 masks,
as the tutorials' `masked_fill(mask == 0, ...)` uses them, are read as boolean.
`torch.nn.MultiheadAttention` uses the opposite boolean convention (True = masked out); the check
against it inverts the mask (see check.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Union

from attnscope.errors import UsageError

if TYPE_CHECKING:
    import torch

CausalAlign = Literal["upper-left", "lower-right"]
Device = Union["torch.device", str, None]


def causal_mask(n_Q: int, n_K: int, align: CausalAlign = "upper-left", device: Device = None) -> torch.Tensor:
    """[n_Q, n_K] boolean. Upper-left: query i sees keys j <= i, as `is_causal=True` does.
    Lower-right: the last query sees every key, as `torch.nn.attention.bias.causal_lower_right`."""
    import torch

    offset = 0 if align == "upper-left" else n_K - n_Q
    rows = torch.arange(n_Q, device=device).unsqueeze(-1)  # [n_Q, 1]
    cols = torch.arange(n_K, device=device)  # [n_K]
    return cols <= rows + offset  # [n_Q, n_K]


def key_padding_mask(n_K: int, n_pad: int, device: Device = None) -> torch.Tensor:
    """[n_K] boolean that hides the last `n_pad` keys of every sequence."""
    import torch

    if not 0 <= n_pad < n_K:
        raise UsageError(f"--pad {n_pad} must hide fewer keys than there are (n_K = {n_K}) and not be negative")
    return torch.arange(n_K, device=device) < n_K - n_pad


def as_attention_mask(mask: torch.Tensor, scores_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Check that `mask` broadcasts to the scores and put it in the boolean-or-additive convention."""
    import torch

    from attnscope.cost import broadcast_shapes

    try:
        broadcast: tuple[int, ...] | None = broadcast_shapes(tuple(mask.shape), scores_shape)
    except ValueError:
        broadcast = None
    if broadcast != tuple(scores_shape):
        raise UsageError(
            f"mask of shape {list(mask.shape)} does not broadcast to the scores' shape {list(scores_shape)}; "
            "give a mask whose trailing dims are [n_Q, n_K] (or 1 where it is shared)"
        )
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        return mask.to(dtype)
    if mask.is_complex():
        raise UsageError("a complex mask means nothing here: give a boolean (True = may attend) or float mask")
    if mask.device.type != "meta" and not bool(((mask == 0) | (mask == 1)).all()):
        raise UsageError(
            "an integer mask must hold only 0 (masked) and 1 (may attend); "
            "for an additive mask give floats (0 keeps a score, -inf removes it)"
        )
    return mask != 0


def combine(first: torch.Tensor | None, second: torch.Tensor | None) -> torch.Tensor | None:
    """Both must hold for a key to be seen: AND for boolean masks, a sum when either is additive."""
    if first is None or second is None:
        return first if second is None else second
    if first.dtype == second.dtype and first.dtype.is_floating_point is False:
        return first & second
    return to_additive(first) + to_additive(second)


def to_additive(mask: torch.Tensor) -> torch.Tensor:
    """Boolean mask -> float mask of 0 (may attend) and -inf (masked); float masks pass through."""
    import torch

    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))


def fully_masked_rows(mask: torch.Tensor) -> torch.Tensor:
    """Boolean `[.., n_Q, 1]`: True where a query may attend to no key at all."""
    import torch

    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1, keepdim=True)
    return torch.isneginf(mask).all(dim=-1, keepdim=True)
