"""Heads made of every n_head-th feature: code that splits each projection `view(.., d_head, n_head)` and moves the
heads in front (SuperGlue's `view(B, dim, heads, N)`; BERT's `transpose_for_scores` written `(head_size, heads)`)
computes multi-head attention whose head h reads features h, h + n_head, ... of its queries, keys and values alike: a
checkpoint trained so lays its heads so, and no weight could tell it from a checkpoint laid (n_head, d_head) with its
rows moved. Split so in the queries', keys' and values' projections all, it is a convention, read here (the reference
splits so too, and merges its heads back the same way round, head the fastest); the queries alone split so is the
catalog's `heads.split_transposed`.

Asked only where the line-up diverges at a split (or at the values' projection, which a strided view of values made
from the wrong input may be paired with first) and the code holds a tensor laid `[.., d_head, n_head, ..]`; kept only
where the queries' and keys' splits then line up and the line-up goes further (conventionread.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from attnscope.usertrace.lined import ALIGNED

if TYPE_CHECKING:
    from attnscope.usertrace.lined import LineUp
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Spec

SPLITS = ("Q_split", "K_split", "V_split")


def reading(spec: Spec, first: LineUp, records: list[Record], sizes: dict[str, int]) -> Spec | None:
    """The spec to line up again under, heads split strided and merged back so (merged head-major instead, they read
    as heads.merge_wrong_permute), where `first` diverges at a split (or at V_feat) and the code holds a tensor laid
    with d_head before n_head; None otherwise."""
    n_head, d_head = sizes.get("n_head"), sizes.get("d_head")
    div = first.divergence
    if spec.strided_heads or div is None or div.reference not in (*SPLITS, "V_feat") or not n_head or not d_head \
            or n_head < 2 or d_head < 2 or spec.pooled is not None:
        return None
    laid = any(tuple(r.tensor.shape[i:i + 2]) == (d_head, n_head) for r in records
               for i in range(max(r.tensor.dim() - 1, 0)))
    return replace(spec, strided_heads=True) if laid else None


def kept(again: LineUp) -> bool:
    """Whether a strided reading lines up the queries' and the keys' splits, which make the heads each score reads
    (the values' may then diverge: a mistake of its own, values from the keys, named by experiment)."""
    rows = {row.reference: row.status for row in again.rows}
    return again.no_reference is None and all(rows.get(step) in ALIGNED for step in SPLITS[:2])


def note(line: int | None, clean: bool) -> str:
    """The convention, said."""
    where = f" (line {line})" if line is not None else ""
    merged = "merged back the same way round, head the fastest (x_raw.permute(0, 2, 3, 1) before the view)"
    done = "the reference split its heads so too, and lines up" if clean else \
        "the reference split its heads so too; the divergence below is another matter"
    return (f"heads strided: your code splits its queries, keys and values each as (d_head, n_head){where}, "
            f"view(.., d_head, n_head) then the heads moved in front, so head h takes features h, h + n_head, ..., "
            f"and {merged}: a checkpoint's layout of its heads (SuperGlue's), not a mistake; {done}")
