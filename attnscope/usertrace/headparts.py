"""Queries and keys that carry a part of their own in each head beside the projections': Conditional DETR's and
DAB-DETR's cross-attention joins each head's content query with a positional one (`torch.cat([q, q_pos], dim=3)`
on `[n_batch, n, n_head, d_head]`), and its keys likewise, so the scores contract over `d_head + d_pos` and are
`q · kᵀ + q_pos · k_posᵀ`, scaled by `(d_head + d_pos) ** -0.5` (transformers' ConditionalDetrAttention: its
`embed_dim` is twice the values').

Read off the scores' product and the numbers: the two operands of the product a softmax is computed from, laid out
as the reference's heads (`[n_batch, n_head, n, D]`, or `[n_batch·n_head, n, D]` as bmm takes them; the keys' side
as it is or transposed), each holding the reference's queries (keys) in `d_head` of its `D > d_head` columns, first
or last, times a number (a scale applied to the joined tensor). The other columns are the code's own part; their
product is a term on the scores, added before the scale (ownterm.Term), and the reference's scale, unless --scale
says one, is `1/√D`, as the code's scores contract over D.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnscope.usertrace.align import factor_of
from attnscope.usertrace.record import Record

PRODUCTS = ("matmul", "__matmul__", "__rmatmul__", "bmm")
Q_STEPS = ("Q_rot", "Q_normed", "Q_split")
K_STEPS = ("K_rep", "K_cat", "K_rot", "K_normed", "K_split")


@dataclass
class Joined:
    term: torch.Tensor  # q_pos · k_posᵀ, the reference's scores layout [.., n_Q, n_K], float64
    width: int  # D: the width the code's scores contract over
    record: Record  # the product
    note: str


def joined(records: list[Record], trace: object, softmaxed: set[int]) -> Joined | None:
    """The code's own parts of its queries and keys, where its scores' product reads the reference's queries and
    keys joined with them per head; None where no product does."""
    q_step = next((n for n in Q_STEPS if n in trace), None)  # type: ignore[operator]
    k_step = next((n for n in K_STEPS if n in trace), None)  # type: ignore[operator]
    if q_step is None or k_step is None:
        return None
    queries, keys = trace[q_step].double(), trace[k_step].double()  # type: ignore[index]
    if queries.dim() != 4 or keys.dim() != 4 or queries.shape[:2] != keys.shape[:2] \
            or queries.shape[-1] != keys.shape[-1]:
        return None
    for record in records:
        operands = [value for kind, value in record.args if kind == "rec"]
        if record.func not in PRODUCTS or record.index not in softmaxed or len(operands) != 2:
            continue
        left = _heads(records[operands[0]].tensor, queries, False)
        right = _heads(records[operands[1]].tensor, keys, True)
        if left is None or right is None or left.shape[-1] != right.shape[-1]:
            continue
        q_part, k_part = _own_part(left, queries), _own_part(right, keys)
        if q_part is None or k_part is None or q_part[2] != k_part[2]:
            continue  # held at other places on the two sides, each content column meets another side's own: no term
        (q_own, q_factor, first), (k_own, k_factor, _) = q_part, k_part
        term = q_own @ k_own.transpose(-2, -1) / (q_factor * k_factor)
        if not bool(torch.isfinite(term).all()):
            continue
        width, d_head = int(left.shape[-1]), int(queries.shape[-1])
        where = "after" if first else "before"
        note = (f"your scores (line {record.line}) contract over {width} columns a head: your queries and keys each "
                f"join a part of their own ({width - d_head} wide) {where} the projections' {d_head} "
                "(Conditional DETR's positional queries and keys, `torch.cat([q, q_pos], dim=-1)` per head): the "
                "reference adds the product of those parts to its scores before the scale, as your run computes "
                "it; a convention, not a mistake")
        return Joined(term, width, record, note)
    return None


def _heads(tensor: torch.Tensor, like: torch.Tensor, keys: bool) -> torch.Tensor | None:
    """`tensor` as `[n_batch, n_head, n, D]` beside the reference's `like` `[n_batch, n_head, n, d_head]` (a bmm's
    `[n_batch·n_head, ..]` unfolded; the keys' side transposed back where it is `[.., D, n]`), D > d_head; else
    None."""
    if not tensor.is_floating_point() or tensor.dim() not in (3, 4):
        return None
    n_batch, n_head, n, d_head = like.shape
    held = tensor.double()
    if held.dim() == 3:
        if held.shape[0] != n_batch * n_head:
            return None
        held = held.reshape(n_batch, n_head, *held.shape[1:])
    if tuple(held.shape[:2]) != (n_batch, n_head):
        return None
    if keys and held.shape[-1] == n and held.shape[-2] > d_head:
        held = held.transpose(-2, -1)
    if held.shape[-2] != n or held.shape[-1] <= d_head:
        return None
    return held


def _own_part(held: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, float, bool] | None:
    """The columns of `held` that are not the reference's (the code's own part), the number the reference's columns
    are times theirs, and whether the reference's come first; None where neither `d_head` columns at the start nor
    at the end hold the reference times a number."""
    d_head, width = int(reference.shape[-1]), int(held.shape[-1])
    for first in (True, False):
        content = held[..., :d_head] if first else held[..., width - d_head:]
        factor = factor_of(content, reference)
        if factor is not None:
            return (held[..., d_head:] if first else held[..., : width - d_head]), factor, first
    return None
