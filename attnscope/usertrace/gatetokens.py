"""Whether an output gate is each query's own: a gate computed from the input (Qwen3-Next's `sigmoid(gate)` from the
query projection's extra rows, OpenFold's `sigmoid(linear_g(q_x))`) multiplies query n's output by a factor made from
token n alone. Read from the run: each value of the factor (or of the tensor an elementwise activation made it from)
is looked up among the projection's outputs, which says the token it came from; laid out as the reference's x_raw
`[n_batch, n_head, n_Q, d_head]`, the tokens must run along n_Q. A gate viewed in another head layout than the
output's (`sigmoid(gate).view(b, h, n, d)` on a gate laid out [b, n, h·d]) gives query n another token's factor: a
mistake of the code, which the reference does not take as a convention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record

UNARY_LIMIT = 8  # records walked up from the factor to the projection's values


def tokens(factor: Record, records: list[Record], n_q: int) -> torch.Tensor | None:
    """The token of the projection's input each value of `factor` comes from, shaped as the factor; None where the
    run does not say (no one projection above it, values made twice, an activation that is not elementwise)."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.fused import nearest_ancestors
    from attnscope.usertrace.valueindex import ValueIndex

    above = ancestors(factor, records) | {factor.index}
    made = [r for r in records if r.index in above and r.style == "linear" and r.tensor.is_floating_point()]
    if len(made) != 1 or made[0].tensor.dim() != 3 or made[0].tensor.shape[1] != n_q \
            or made[0].tensor.shape[0] == n_q:  # tokens on axis 1 of [n_batch, n_Q, width], and no other
        return None
    output = made[0].tensor.detach()
    width = int(output.shape[-1])
    lookup = ValueIndex.of(output)
    if lookup is None:
        return None
    value = factor.tensor.detach()
    for record in nearest_ancestors(records, factor.index, UNARY_LIMIT):
        tensor = record.tensor
        if not tensor.is_floating_point() or tensor.dtype != output.dtype or record.index == made[0].index:
            continue
        inner = ValueIndex.of(tensor.detach())
        at = inner.positions(value) if inner is not None else None  # the factor's values, rearranged from it
        if at is None:
            continue
        source = _source(record, records, lookup)
        if source is not None:
            return (source.reshape(-1)[at] // width) % int(output.shape[1])
    return None


def own_tokens(tok: torch.Tensor) -> bool:
    """Whether `tok`, laid out as x_raw [n_batch, n_head, n_Q, d_head], holds query n's own token at each n."""
    n_q = tok.shape[2]
    want = torch.arange(n_q).view(1, 1, n_q, 1)
    return bool((tok == want).all())


def _source(record: Record, records: list[Record], lookup: object) -> torch.Tensor | None:
    """Each value of `record`'s tensor as a flat position in the projection's output: its own values, or those of
    the one parent of the same shape an elementwise activation made it from (sigmoid, SiLU)."""
    found = lookup.positions(record.tensor.detach())  # type: ignore[attr-defined]
    if found is not None:
        return found
    parents = [records[p] for p in record.parents if records[p].tensor.shape == record.tensor.shape]
    if len(record.parents) != 1 or len(parents) != 1:
        return None
    return lookup.positions(parents[0].tensor.detach())  # type: ignore[attr-defined]

