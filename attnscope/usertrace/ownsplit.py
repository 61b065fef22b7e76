"""The code's own content product `q · kᵀ` where its queries line up with no reference step: a fused projection
(Q_feat unseen) split into heads otherwise than the reference splits it (Segment Anything's qkv reshaped
(B, N, 3, h, d) and permuted (2, 0, 1, 3, 4), the permute that moves the heads before the tokens left out), a relative
term then made from those queries too. ownterm.py takes the term as the sum less this product, so the rerun of the
mistake, adding it, gives the code's scores back.

Read off the data flow: the product on the way to the softmax is a matmul of two tensors, each the code's queries or
keys, maybe times a number (SAM's `(query * self.scale) @ key.transpose(-2, -1)`). The queries' layout (the batch
folded with the heads, [B·h, N, d]) is the one that keeps every sequence's numbers in its own batch row, whatever the
code did within it: a split mistake moves values between heads and positions, never between sequences.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace.align import Layout, layouts, tolerance

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record

SCALINGS = ("mul", "__mul__", "__rmul__", "div", "__truediv__", "mul_", "div_", "__imul__", "__itruediv__")
VIEWS = ("view", "reshape", "contiguous", "view_as", "reshape_as", "clone")


def own_product(records: list[Record], trace: Any, add: Record) -> tuple[Record, Record, torch.Tensor] | None:
    """Where an operand of `add` (an add on the way to the softmax) is the code's product of its queries and keys,
    maybe times a number: the queries' record, the keys', and that product unscaled in the reference's scores
    layout; None elsewhere."""
    from attnscope.usertrace.record import MATMULS

    if "Q_feat" not in trace or "scores" not in trace:
        return None
    for given in _rec_args(add):
        product = _unscaled(records[given], records, through_views=True)
        args = _rec_args(product)
        if product.func.split(".")[-1] not in MATMULS or len(args) != 2:
            continue
        queries, keys = (_unscaled(records[a], records) for a in args)
        if queries.tensor.dim() < 2 or not queries.tensor.is_floating_point():
            continue
        layout = _batch_kept(queries.tensor, trace["Q_feat"])
        if layout is None:
            continue
        content = (queries.tensor.double() @ keys.tensor.double()).reshape(product.tensor.shape)
        laid = next((s for s in layouts(tuple(trace["scores"].shape), tuple(content.shape)) if s.order == layout.order),
                    None)
        if laid is not None:
            return queries, keys, laid.undo(content, tuple(trace["scores"].shape)).double()
    return None


def _batch_kept(queries: torch.Tensor, projected: torch.Tensor) -> Layout | None:
    """The layout of the reference's split queries [B, h, N, d] that `queries` holds, where under it each sequence's
    numbers are those of its own row of Q_feat [B, N, h·d] (in whatever order); None where no layout is."""
    n_batch, n, d_feat = projected.shape
    d_head = queries.shape[-1]
    if d_feat % d_head or queries.numel() != projected.numel():
        return None
    shape = (n_batch, d_feat // d_head, n, d_head)
    for layout in layouts(shape, tuple(queries.shape)):
        held = layout.undo(queries, shape).double().reshape(n_batch, -1).sort(-1).values
        want = projected.double().reshape(n_batch, -1).sort(-1).values
        if float((held - want).abs().max()) <= tolerance(projected.float()):
            return layout
    return None


def _unscaled(record: Record, records: list[Record], through_views: bool = False) -> Record:
    """`record` before any multiplication (or division) by a number, and with `through_views` any view, that made it
    from one tensor of its shape."""
    while True:
        parents = _rec_args(record)
        if len(parents) != 1 or record.func not in (*SCALINGS, *(VIEWS if through_views else ())):
            return record
        source = records[parents[0]]
        if record.func in SCALINGS and tuple(source.tensor.shape) != tuple(record.tensor.shape):
            return record
        record = source


def _rec_args(record: Record) -> list[int]:
    return [value for kind, value in record.args if kind == "rec"]
