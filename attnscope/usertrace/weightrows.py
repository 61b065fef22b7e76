"""Rows of a packed weight that the code cuts out itself before it projects with them.

torch's own `F._in_projection` cuts nn.MultiheadAttention's `in_proj_weight` into three (`w_q, w_k, w_v =
in_proj_weight.chunk(3)`) and calls `F.linear(query, w_q, b_q)`; others slice it (`[:E]`, `[E:2 * E]`), split it by
grouped-query sizes (`torch.split(qkv.weight, [dq, dk, dv])`), view it as `[3, E, E]` (or unflatten it) and index it,
or hold a stacked `[3, E, E]` parameter and project with `W[i]`. Each such cut is a view of the parameter: where it is
a run of whole rows of the parameter's first axis (its storage offset and size against the parameter's, both laid
out in the parameter's order), the recorder holds it as a weight of its own, named by those rows
(`in_proj_weight[32:64]`, `W[1]`), so the data flow reads its role as it reads any Linear's. Never by its name: a cut
that is no run of whole rows (a column, a strided slice) stays an ordinary op.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

_CUT = re.compile(r"(.+)\[(\d+)(?::(\d+))?\]")


def cut_rows(name: str) -> tuple[str, int, int, bool] | None:
    """The parameter and rows a cut's name says (`part` names them): `in_proj_weight[32:64]` -> ("in_proj_weight",
    32, 64, True), `W[1]` -> ("W", 1, 2, False), the last saying whether the name is a run of rows (an index drops
    the axis); None for a name that is no cut's (an nn.Linear's)."""
    found = _CUT.fullmatch(name)
    if found is None:
        return None
    first = int(found[2])
    return found[1], first, int(found[3]) if found[3] else first + 1, found[3] is not None


class Origin(NamedTuple):
    """Where a weight's values lie: its parameter's name, the size of one row of the parameter's first axis, the
    storage offset the parameter's first value sits at in this tensor's storage, and the parameter's rank."""

    name: str
    row: int
    offset: int
    dim: int


def _origin(known: Origin | None, source: torch.Tensor, name: str) -> Origin | None:
    """`known`, or the parameter `source` itself as the origin of the cuts made from it (laid out in its order)."""
    if known is not None:
        return known
    if not isinstance(source, torch.nn.Parameter) or not source.is_contiguous() or source.dim() < 2 \
            or source.shape[0] < 2:
        return None
    return Origin(name, source.numel() // source.shape[0], int(source.storage_offset()), source.dim())


def whole(known: Origin | None, source: torch.Tensor, made: torch.Tensor, name: str) -> dict[int, Origin]:
    """A weight reshaped or cast whole: its values in the parameter's order where it is laid out contiguously (a
    copy, `.float()`, counts from its own first value); none where its order is another (`.t()`)."""
    origin = _origin(known, source, name)
    if origin is None or not made.is_contiguous() or not source.is_contiguous():
        return {}
    shared = made.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
    return {id(made): origin if shared else origin._replace(offset=int(made.storage_offset()))}


def part(known: Origin | None, source: torch.Tensor, made: torch.Tensor, name: str) -> tuple[str, Origin] | None:
    """A cut of a weight (`chunk`, `split`, `unbind`, indexing, `narrow`) that is a run of whole rows of its
    parameter: its name (`in_proj_weight[32:64]`, or `W[1]` where one row of a stacked parameter is taken and its
    axis dropped) and its origin; None for any other cut."""
    origin = _origin(known, source, name)
    if origin is None or not made.is_contiguous() or not source.is_contiguous() or made.numel() == 0:
        return None
    if made.untyped_storage().data_ptr() != source.untyped_storage().data_ptr():
        return None
    start = made.storage_offset() - origin.offset
    if start < 0 or start % origin.row or made.numel() % origin.row:
        return None
    first, count = start // origin.row, made.numel() // origin.row
    label = f"[{first}]" if count == 1 and made.dim() < origin.dim else f"[{first}:{first + count}]"
    return f"{origin.name}{label}", origin
