"""Where a tensor's values stand in another's, found by value: a projection's output sorted once, each value of a
tensor made from it looked up there. It says which of the output's elements (so which rows, which columns) the
code's tensor holds, where no op records say it (a chunk, a view and an index in any order). Read only where every
value of the output is made once: a value made twice cannot say where it came from; but for fused.solve_rows, which
takes a few values two outputs hold by chance (`of_few_ties`) and tries each at either place (`tie_placings`).
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

    @classmethod
    def of_few_ties(cls, output: torch.Tensor, most: int = 4) -> tuple[ValueIndex, dict[int, int]] | None:
        """The index of `output`'s values where at most `most` of them are made twice, by chance (two float32 sums
        that round alike): each such pair kept once, with {flat position: the other's}, so that a reader may try
        both (`tie_placings`); None where more are, or one is made three times (a structure, not a chance)."""
        ordered, where = torch.sort(output.reshape(-1))
        same = (ordered[1:] == ordered[:-1]).nonzero().reshape(-1)
        if same.numel() > most or bool((same[1:] - same[:-1] == 1).any()):
            return None
        other = {int(where[i]): int(where[i + 1]) for i in same.tolist()}
        keep = torch.ones(ordered.numel(), dtype=torch.bool)
        keep[same + 1] = False
        return cls(ordered[keep], where[keep]), other

    def positions(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The flat position in the output of each of `tensor`'s values, shaped as `tensor`; None where a value is
        not the output's."""
        values = tensor.reshape(-1)
        at = torch.searchsorted(self.ordered, values).clamp(max=self.ordered.numel() - 1)
        if not torch.equal(self.ordered[at], values):
            return None
        return self.where[at].reshape(tensor.shape)


def tie_placings(source: torch.Tensor, other: dict[int, int]) -> list[torch.Tensor]:
    """`source` (flat positions, from ValueIndex.positions) with each combination of its tied positions (`other`,
    ValueIndex.of_few_ties) moved to the other place that holds the same value, the unmoved first."""
    flat = source.reshape(-1)
    tied = [(i, other[int(p)]) for i, p in enumerate(flat.tolist()) if int(p) in other]
    found = [source]
    for pick in range(1, 2 ** len(tied)):
        moved = flat.clone()
        for bit, (i, place) in enumerate(tied):
            if pick >> bit & 1:
                moved[i] = place
        found.append(moved.reshape(source.shape))
    return found
