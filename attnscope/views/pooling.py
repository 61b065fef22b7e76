"""Fitting an attention pattern into fewer cells than it has queries and keys, for the pictures.

Neighbouring keys are summed: a cell holds the weight its query put on that group of keys, so a pooled row
still sums to what the row summed to (1, or 0 for a query that may see no key). Neighbouring queries are
averaged: a cell is the group's mean query. A previous-token diagonal or a first-token column stays as sharp
as the cells allow, and a broad head stays even. The last group of each axis takes what is left (it may be
smaller). A NaN weight makes its cell NaN, so the picture still shows it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

THUMB_COLS = 6  # key columns of one head's heatmap in the all-layers grid (render/beyond_layer.py)
THUMB_ROWS = 3  # query rows; runs/streamed_layers.py pools each layer to these as it comes


def group_size(n: int, cells: int) -> int:
    """How many neighbours go into one cell so that `n` of them fit in `cells` cells."""
    return max(1, math.ceil(n / max(cells, 1)))


def pool(pattern: Tensor, rows: int = 1, cols: int = 1) -> Tensor:
    """`[.., n_Q, n_K]` -> `[.., ceil(n_Q / rows), ceil(n_K / cols)]`: keys summed in groups of `cols`,
    queries averaged in groups of `rows` (in float64 for the sums; the result in float64)."""
    import torch

    A = pattern.detach()
    *lead, n_Q, n_K = A.shape
    if cols > 1 and n_K:  # summed in float64 from the pattern itself: no padded float64 copy of [.., n_Q, n_K]
        full = n_K - n_K % cols
        groups = [A.unfold(-1, cols, cols).sum(dim=-1, dtype=torch.float64)] if full else []  # [.., n_Q, full / cols]
        if full < n_K:  # the last group takes what is left
            groups.append(A[..., full:].sum(dim=-1, keepdim=True, dtype=torch.float64))  # [.., n_Q, 1]
        A = torch.cat(groups, dim=-1) if len(groups) > 1 else groups[0]  # [.., n_Q, ceil(n_K / cols)]
    else:
        A = A.to(torch.float64)
    if rows > 1 and n_Q:
        pad = -n_Q % rows
        counts = torch.full((n_Q + pad,), 1.0, dtype=torch.float64)
        counts[n_Q:] = 0.0
        A = torch.nn.functional.pad(A.transpose(-1, -2), (0, pad)).transpose(-1, -2)  # [.., n_Q + pad, m]
        summed = A.reshape(*lead, (n_Q + pad) // rows, rows, A.shape[-1]).sum(dim=-2)  # [.., n_Q / rows, m]
        A = summed / counts.reshape(-1, rows).sum(dim=-1)[:, None]  # [.., n_Q / rows, m] / [n_Q / rows, 1]
    return A


def pool_masked(masked: Tensor, rows: int = 1, cols: int = 1) -> Tensor:
    """A boolean `[.., n_Q, n_K]` mask (True: the key is hidden) pooled as `pool` pools the pattern: a cell is
    masked where the mask hid every key of every query pooled into it."""
    return pool((~masked).double(), rows, cols) == 0
