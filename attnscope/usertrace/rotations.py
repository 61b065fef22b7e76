"""RoPE's table as 2x2 rotation matrices, one for each pair of a head's coordinates (Black Forest Labs' Flux: EmbedND
makes `pe` so, and apply_rope multiplies it into pairs of q and k: `pe[..., 0] * x_[..., 0] + pe[..., 1] *
x_[..., 1]`): the layouts trace makes them in, and the matrices of the reference's own angles
(feeds.py gives them; tableforms.holders tries them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# RoPE's 2x2 rotation matrices [[cos, -sin], [sin, cos]] for each pair, [.., d_head / 2, 2, 2] (Flux's `pe`, which
# EmbedND makes [n_batch, 1, n_Q, d_head / 2, 2, 2] and apply_rope multiplies into pairs of q): heads before the
# tokens (Flux's), tokens before the heads, or one table for all sequences
MATRICES = {"matrices": ("n_batch", "1", "n_Q", "d_head/2", "2", "2"),
            "matrices, tokens first": ("n_batch", "n_Q", "1", "d_head/2", "2", "2"),
            "matrices, shared": ("n_Q", "d_head/2", "2", "2")}


def rotations(cos: torch.Tensor, sin: torch.Tensor, holds: str, n_batch: int) -> torch.Tensor:
    """RoPE's angles (`cos`, `sin` [n_Q, d_head / 2], one a pair) as 2x2 rotation matrices [[cos, -sin], [sin, cos]],
    laid as MATRICES[holds] says: a pair (x0, x1) turned by one is (cos·x0 - sin·x1, sin·x0 + cos·x1), the
    reference's rotation of that pair."""
    import torch

    table = torch.stack([cos, -sin, sin, cos], dim=-1).unflatten(-1, (2, 2))  # [n_Q, d_head / 2, 2, 2]
    if holds == "matrices, shared":
        return table
    axis = 1 if holds == "matrices" else 2  # the heads' axis, of size 1
    return table.unsqueeze(0).unsqueeze(axis).expand(n_batch, *table.unsqueeze(axis - 1).shape).contiguous()
