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
        (`copy_`, `fill_`, `zero_`) all of them. A write through a view of it counts as writing it whole."""
        cells = self._cells.get(id(tensor))
        if cells is None:
            base = tensor._base
            if base is not None and id(base) in self._cells:
                self._cells[id(base)].fill_(False)
            return
        if name == "__setitem__" and len(args) > 1:
            try:
                cells[args[1]] = False
            except (IndexError, RuntimeError, TypeError, ValueError):  # an index read otherwise: counted whole
                cells.fill_(False)
        else:
            cells.fill_(False)

    def blank(self, tensor: torch.Tensor) -> bool:
        """Whether some cell of `tensor` still holds what memory held."""
        cells = self._cells.get(id(tensor))
        return cells is not None and bool(cells.any())
