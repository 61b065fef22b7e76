"""Tensors made uninitialised and filled by the code after (DeepSeek-V2's `query_states = k_pe.new_empty(...)`,
then `query_states[..., :d_nope] = q_nope` and `query_states[..., d_nope:] = q_pe`): which of their cells still hold
whatever memory held. A snapshot taken before every cell is written is never a step's stand-in
(align.candidates), whose max |diff| would be that memory's (1e+13 one run, 5e+31 the next)."""

from __future__ import annotations

from typing import Any

import torch

UNINITIALISED = ("empty", "new_empty", "empty_like", "empty_strided")


class Unwritten:
    """The cells not yet written of each uninitialised tensor the code made, by id (the recorder keeps each
    tensor alive, so an id names one tensor for the whole run)."""

    def __init__(self) -> None:
        self._cells: dict[int, torch.Tensor] = {}

    def made(self, name: str, tensor: torch.Tensor) -> None:
        if name in UNINITIALISED:
            self._cells[id(tensor)] = torch.ones(tensor.shape, dtype=torch.bool)

    def written(self, name: str, args: list[Any], tensor: torch.Tensor) -> None:
        """`tensor` changed in place: by `tensor[index] = value` the cells of `index`, by any other in-place op
        (`copy_`, `fill_`, `zero_`) all of them; through a view, the cells the view covers (DeepSeek-V2's
        `key_states[..., :d_nope].copy_(k_nope)` writes the no-RoPE part alone)."""
        cells = self._cells_of(tensor)
        if cells is None:
            return
        if name == "__setitem__" and len(args) > 1:
            try:
                cells[args[1]] = False
            except (IndexError, RuntimeError, TypeError, ValueError):  # an index read otherwise: counted whole
                cells.fill_(False)
        else:
            cells.fill_(False)

    def blank(self, tensor: torch.Tensor) -> bool:
        """Whether some cell of `tensor` (or of the uninitialised tensor it is a view of, where it covers them)
        still holds what memory held."""
        cells = self._cells_of(tensor)
        return cells is not None and bool(cells.any())

    def _cells_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The unwritten-cell flags `tensor` covers: its own, else, for a view of a noted tensor, a view of that
        tensor's flags laid out as the view lies in its memory (the whole tensor's where that cannot be read: a view
        of another dtype, a base not laid out contiguously). None where it is neither."""
        cells = self._cells.get(id(tensor))
        if cells is not None:
            return cells
        base = tensor._base
        whole = self._cells.get(id(base)) if base is not None else None
        if whole is None or base is None:
            return None
        if tensor.dtype != base.dtype or not base.is_contiguous():
            return whole
        try:
            offset = tensor.storage_offset() - base.storage_offset()
            return whole.as_strided(tuple(tensor.shape), tensor.stride(), offset)
        except RuntimeError:
            return whole
