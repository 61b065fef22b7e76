"""Rows a mask leaves keyless: a query the mask (trace's key padding, a --mask file with a sequence all padding, a
causal rule over a left-padded sequence) lets see no key at all. What the code makes of such a row is its own
convention (NaN under -inf, a uniform row under finfo.min, zeros under PyTorch's SDPA), never a sign that the mask
was given in the wrong form: the judges of a form (runs/trace_mask.fed_well, masking.starved, masking.holds,
maskforms.drowned) read the other rows alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def keyless(allowed: torch.Tensor | None, sizes: dict[str, int]) -> torch.Tensor | None:
    """`[n_batch, n_Q]`, True where the mask `allowed` (True = may attend, in any shape maskranks.laid reads) leaves
    the query no key; None where it leaves every query one, or its axes cannot be read."""
    import torch

    from attnscope.usertrace.maskranks import laid

    if allowed is None or allowed.dtype != torch.bool or bool(allowed.any(-1).all()):
        return None
    grid = laid(allowed, sizes)
    if grid is None:
        return None
    rows = ~grid.any(-1)
    return rows if bool(rows.any()) else None


def outside(t: torch.Tensor, rows: torch.Tensor | None, queries_last: bool = False) -> torch.Tensor | None:
    """Which elements of `t` (batch-major: n_batch first, or a multiple of it where heads are folded into it) lie
    outside the keyless `rows` [n_batch, n_Q]: its query axis the first after the batch of n_Q's size, or its last
    (`queries_last`: a pattern's rows, [.., n_Q]); a whole sequence where none is and every query of it is keyless.
    None where every element counts (no keyless row, a tensor not laid over the batch)."""
    if rows is None or t.dim() < 1 + (not queries_last):
        return None
    n_batch, n_Q = rows.shape
    if t.shape[0] % n_batch:
        return None
    view = t.reshape(n_batch, -1, *t.shape[1:])
    if queries_last:
        axes = [view.dim() - 1] if view.shape[-1] == n_Q else []
    else:
        axes = [a for a in range(2, view.dim()) if view.shape[a] == n_Q] if n_Q > 1 else []
    shape = [n_batch] + [1] * (view.dim() - 1)
    if axes:
        shape[axes[0]] = n_Q
        hidden = rows.reshape(shape)
    else:
        hidden = rows.all(-1).reshape(shape)
    return ~hidden.expand(view.shape).reshape(t.shape)


def finite(t: torch.Tensor, rows: torch.Tensor | None) -> bool:
    """Whether `t` holds no NaN and no +inf outside the keyless `rows`."""
    import torch

    bad = torch.isnan(t) | torch.isposinf(t)
    kept = outside(t, rows)
    return not bool((bad & kept).any() if kept is not None else bad.any())


def rows_kept(per_row: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """`per_row` [.., n_Q] (one value a query: a pattern's row saw no key, a row of scores all masked) where the
    query is not keyless (False on the keyless rows); `per_row` as it is where they cannot be laid on it."""
    kept = outside(per_row, rows, queries_last=True)
    return per_row & kept if kept is not None else per_row
