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


def laid(allowed: torch.Tensor, sizes: dict[str, int]) -> torch.Tensor | None:
    """The mask `allowed` (True = may attend) as `[n_batch, n_Q, n_K]`, from key padding `[n_batch, n_K]` (HF BERT's
    2-D attention_mask) or a mask `[.., n_Q or 1, n_K]` of one head; None where it is neither, or the sizes leave
    its axes ambiguous (n_batch equal to n_Q or n_K)."""
    n_batch, n_Q, n_K = sizes.get("n_batch"), sizes.get("n_Q"), sizes.get("n_K")
    if n_batch is None or n_Q is None or n_K is None or allowed.dim() < 2 or allowed.dim() > 4 \
            or allowed.shape[-1] != n_K or (n_batch > 1 and n_batch in (n_Q, n_K)):
        return None
    keys = allowed.dim() == 2 and allowed.shape[0] == n_batch > 1
    one = allowed[:, None, :] if keys else allowed  # [.., n_Q or 1, n_K]
    if one.shape[-2] not in (1, n_Q) or (one.dim() == 4 and one.shape[1] != 1) or (
            one.dim() > 2 and one.shape[0] not in (1, n_batch)):
        return None
    return one.reshape(-1, one.shape[-2], n_K).expand(n_batch, n_Q, n_K)


def keyless(allowed: torch.Tensor | None, sizes: dict[str, int]) -> torch.Tensor | None:
    """`[n_batch, n_Q]`, True where the mask `allowed` (True = may attend, in any shape laid reads) leaves
    the query no key; None where it leaves every query one, or its axes cannot be read."""
    import torch


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
