"""Where a tensor's values stand in another's, found by value: a projection's output sorted once, each value of a
tensor made from it looked up there. It says which of the output's elements (so which rows, which columns) the
code's tensor holds, where no op records say it (a chunk, a view and an index in any order). Read only where every
value of the output is made once: a value made twice cannot say where it came from.
fused.solve_rows (a fused q/k/v weight's rows), widerows.py (the rows a role reads), laterbias.py (the parts a
parameter is added to) and perhead.py (the columns a head's part holds) read their positions here."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ValueIndex:
    ordered: torch.Tensor  # the output's values, flattened and sorted
    where: torch.Tensor  # each sorted value's flat position in the output

    @classmethod
    def of(cls, output: torch.Tensor) -> ValueIndex | None:
        """The index of `output`'s values; None where a value is made twice."""
        ordered, where = torch.sort(output.reshape(-1))
        if bool((ordered[1:] == ordered[:-1]).any()):
            return None
        return cls(ordered, where)

    def positions(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The flat position in the output of each of `tensor`'s values, shaped as `tensor`; None where a value is
        not the output's."""
        values = tensor.reshape(-1)
        at = torch.searchsorted(self.ordered, values).clamp(max=self.ordered.numel() - 1)
        if not torch.equal(self.ordered[at], values):
            return None
        return self.where[at].reshape(tensor.shape)
