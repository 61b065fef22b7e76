"""A projection that makes more than its role: Qwen3-Next's `q_proj` writes each head's queries and its output gate
side by side (`[n_batch, n, n_head, 2·d_head]`, chunked in two), so the queries are some of its rows and the rest
feed something else (the gate, outgate.py). The rows the role reads are looked up from the code's own tensor: each
value of the queries (keys, values) that reach the scores is found among the projection's outputs, which says its
row (fused.solve_rows does the same for a fused q/k/v weight). The reference holds those rows, in the order the
code's heads read them, and a note says so; a convention of the weights, not a mistake.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Projections


def narrowed(projections: Projections, records: list[Record]) -> Projections:
    """`projections` with each of q, k, v whose projection the code's role tensor reads only some rows of held as
    those rows; as it is where none is."""
    from attnscope.usertrace import flow, fused

    found = flow.operands(records)
    if found is None:
        return projections
    linears, said = dict(projections.linears), []
    for role, index in zip("qkv", found[:3], strict=True):
        if role not in linears:
            continue
        name, linear = linears[role]
        order = _rows(name, records, index)
        weight = getattr(linear, "weight", None)
        if order is None or not isinstance(weight, torch.Tensor) or len(order) >= weight.shape[0] \
                or _all_read(name, records, role, order, weight.shape[0]):
            continue
        part = fused.rows(name, weight, getattr(linear, "bias", None), torch.tensor(order),
                          f"[{fused.row_ranges(order)}]")
        linears[role] = (part.name, part)
        said.append(f"{name} writes {weight.shape[0]} features, of which your {role} reads {len(order)} "
                    f"({part.name}): the reference's {role} projection holds those rows; the rest feed something "
                    "else (a gate, as Qwen3-Next's query projection makes)")
    if not said:
        return projections
    note = "; ".join(said)
    return dataclasses.replace(projections, linears=linears,
                               note=f"{projections.note}; {note}" if projections.note else note)


def _all_read(name: str, records: list[Record], role: str, order: list[int], width: int) -> bool:
    """Whether the role's tensors of every softmax together read all of `name`'s rows: heads processed a few at a
    time (lucidrains' Perceiver AR's `q.split(max_heads, dim=1)`, a softmax a chunk), each chunk reading its heads'
    rows, is the whole projection, not rows beside a gate."""
    from attnscope.usertrace.flow import operands_at
    from attnscope.usertrace.record import SOFTMAXES

    read = set(order)
    for softmax in (r for r in records if r.func.split(".")[-1] in SOFTMAXES):
        found = operands_at(records, softmax)
        index = found["qkv".index(role)] if found is not None else None
        more = _rows(name, records, index) if index is not None else None
        read |= set(more or ())
    return len(read) >= width


def _rows(name: str, records: list[Record], index: int) -> list[int] | None:
    """The rows of `name`'s output that the code's tensor `index` (or the nearest tensor it is made from that holds
    the projection's values as they are) reads, in its heads' order; None where no such tensor reads fewer rows
    than the projection makes, or the projection ran more than once."""
    from attnscope.usertrace.fused import nearest_ancestors, row_order
    from attnscope.usertrace.valueindex import ValueIndex, tie_placings

    made = [r for r in records if r.style == "linear" and r.args and r.args[0] == ("text", name)]
    if len(made) != 1 or not made[0].tensor.is_floating_point():
        return None
    output = made[0].tensor.detach()
    if records[index].tensor.numel() >= output.numel() or made[0].index not in _above(records, index):
        return None
    width = int(output.shape[-1])
    indexed = ValueIndex.of_few_ties(output)  # a few values two sums round alike by chance (fused.solve_rows)
    if indexed is None:  # values made twice, more than by chance: rows cannot be told by value
        return None
    lookup, ties = indexed

    def read(record: Record) -> list[int] | None:
        tensor = record.tensor
        if record.index == made[0].index or not tensor.is_floating_point() or tensor.dtype != output.dtype \
                or tensor.numel() == 0 or tensor.numel() >= output.numel():
            return None
        source = lookup.positions(tensor.detach())
        if source is None:
            return None
        for placed in tie_placings(source, ties):  # a tied value from the place that fits
            order = row_order(placed % width, placed // width)
            if order is not None and len(order) < width:
                return order
        return None

    # the nearest such tensor on each way back from the role's (breadth first, at most 64 looked at): partial RoPE
    # without a norm before it reads a head's rotated coordinates from one slice of the projection's output and the
    # rest from another (Qwen3-Next's q_rot and q_pass), the role's rows the two together
    found: list[list[int]] = []

    def reads(record: Record) -> bool:
        order = read(record)
        if order is not None:
            found.append(order)
        return order is not None

    nearest_ancestors(records, index, stop=reads, avoid=frozenset({made[0].index}))
    # a slice of one of them read on another way (rotate_half's halves of the rotated slice) adds nothing
    sets = [set(order) for order in found]
    kept = [order for i, order in enumerate(found)
            if not any(sets[i] < other or (sets[i] == other and j < i) for j, other in enumerate(sets))]
    if len(kept) <= 1:
        return kept[0] if kept else None
    rows = set().union(*kept)
    return sorted(rows) if sum(map(len, kept)) == len(rows) and len(rows) < width else kept[0]


def _above(records: list[Record], index: int) -> set[int]:
    from attnscope.usertrace.align import ancestors

    return ancestors(records[index], records)
