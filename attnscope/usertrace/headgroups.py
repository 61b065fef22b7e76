"""Groups of tokens the module makes after its projections, with an axis of their own beside the heads: Hiera's mask
unit attention (`qkv.reshape(B, -1, num_windows, 3, heads, head_dim).permute(3, 0, 4, 2, 1, 5)`: q, k and v
`[B, heads, num_windows, N / num_windows, head_dim]`, token t in unit t % num_windows), blocked local attention whose
blocks keep an axis beside the heads. The input is never regrouped itself (regroup.py reads that), so the groups are
read from the queries the scores read: a tensor of the run, made before them, whose rows (its last axis, d_head wide)
are the reference's `Q_split` rows, each once, laid out `[n_batch, .., n_in_group, d_head]` with one axis holding the
heads, one the groups and the one before last the tokens of a group. The reference is run on those groups
(regroup.py), and the code's tensors laid out so (`[n_batch, heads, groups, ..]`) are compared with the groups moved
into the batch axis, `[n_batch·groups, heads, ..]`, as the reference on the groups lays them out."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from attnscope.trace import Trace
    from attnscope.usertrace.record import Record


@dataclass
class HeadGroups:
    index: torch.Tensor  # [n_batch·groups, n_in_group]: each group's tokens, flat over the batch (regroup.Grouping)
    n_batch: int
    n_tokens: int
    record: Record  # the queries cut into groups, as the code made them
    axis: int  # the code's axis of the groups, in its queries' layout
    lead: tuple[int, ...]  # the leading sizes every tensor of the groups' layout has: up to the groups' axis

    def regrouped(self, records: list[Record]) -> list[Record]:
        """The run's records, those laid out as the code's groups (`[n_batch, .., groups, ..]`) with the groups moved
        into the batch axis, `[n_batch·groups, ..]`, as the reference on the groups lays its steps out."""
        out = []
        for record in records:
            t = record.tensor
            if t.dim() > self.axis + 1 and tuple(t.shape[:len(self.lead)]) == self.lead:
                record = dataclasses.replace(record, tensor=t.movedim(self.axis, 1).flatten(0, 1))
            out.append(record)
        return out


def find(records: list[Record], trace: Trace) -> HeadGroups | None:
    """The groups the code's queries are cut into after the projection, read from the tensor nearest before the
    scores whose rows are the reference's Q_split rows, each once; None where there is none."""
    from attnscope.usertrace.align import ancestors, tolerance
    from attnscope.usertrace.flow import operands
    from attnscope.usertrace.gathered import flat_groups

    found = operands(records)
    if found is None or "Q_split" not in trace or trace["Q_split"].dim() != 4:
        return None
    reference = trace["Q_split"].double()  # [n_batch, n_head, n, d_head]
    n_batch, n_head, n, d = reference.shape
    left = records[found[0]]
    if left.tensor.numel() != reference.numel():  # queries pooled inside each group on the way: unitmask.py's
        return None
    tol = tolerance(trace["Q_split"])
    for index in sorted(ancestors(left, records) | {left.index}, reverse=True):
        t = records[index].tensor
        if not t.is_floating_point() or t.dim() < 5 or t.shape[-1] != d or t.numel() != reference.numel():
            continue
        distance = torch.cdist(t.detach().double().reshape(-1, d), reference.reshape(-1, d))
        nearest, row = distance.min(dim=1)
        if float(nearest.max()) > tol * d ** 0.5 or len(set(row.tolist())) != row.numel():
            continue
        places = row.reshape(t.shape[:-1])
        read = _axes(places, n_head, n)
        if read is None:
            continue
        head_axis, group_axis = read
        tokens = (places % n).movedim(group_axis, 1).select(head_axis + (head_axis < group_axis), 0)
        # [n_batch, groups, .., n_in_group] -> [n_batch·groups, n_in_group]: each group's tokens, flat over the batch
        flat = flat_groups(tokens, n)
        return HeadGroups(flat, n_batch, n, records[index], group_axis, tuple(t.shape[:group_axis + 1]))
    return None


def _axes(places: torch.Tensor, n_head: int, n: int) -> tuple[int, int] | None:
    """(the heads' axis, the groups' axis) of a tensor whose every row is the reference's row `places` (flat over
    `[n_batch, n_head, n]`): the batch on axis 0 alone, the heads on one axis alone, the tokens on the groups' axis
    and the one before last; None where the layout is not so."""
    batch, head, token = places // (n_head * n), (places // n) % n_head, places % n
    rank = places.dim()
    varies = [[bool((part.narrow(a, 0, 1) != part).any()) for a in range(rank)] for part in (batch, head, token)]
    if varies[0] != [a == 0 for a in range(rank)]:
        return None
    heads = [a for a in range(rank) if varies[1][a]]
    groups = [a for a in range(1, rank) if varies[2][a]]
    if len(heads) != 1 or heads[0] in groups or len(groups) != 2 or groups[-1] != rank - 1:
        return None
    return heads[0], groups[0]
