"""Attention sinks read from the data flow (GPT-OSS's, transformers' models/gpt_oss `eager_attention_forward`): the
code joins one more column to its scores before the softmax, `cat([scores, sinks.reshape(1, -1, 1, 1).expand(..)],
dim=-1)`, and drops it after (`probs[..., :-1]`), so each row may put part of its weight on nothing. The column is
read where a `cat` on the last axis that a softmax reads has a part one column wide holding one value a head for
every query, those values a tensor the module holds (its `sinks` parameter, whatever its name): the reference then
holds the module's own sinks (attention/sinks.py), a convention the module holds, and a note says it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record

JOINS = ("cat", "concat", "concatenate")


def read(module: Any, records: list[Record], n_head: int | None) -> tuple[torch.Tensor, Record] | None:
    """The module's sink logits `[n_head]` and the record of the join, where its run joins them to its scores;
    None otherwise."""
    if module is None or not n_head or not isinstance(module, torch.nn.Module):
        return None
    held = [t for _, t in (*module.named_parameters(), *module.named_buffers())
            if t.numel() == n_head and t.is_floating_point()]
    if not held:
        return None
    by_index = {r.index: r for r in records}
    for r in records:
        if r.func.split(".")[-1] not in JOINS or not _softmaxed(r, records):
            continue
        column = sink_column(r, by_index, n_head)
        if column is None:
            continue
        values = column.to(torch.float64)
        for t in held:
            mine = t.detach().reshape(-1).to(torch.float64)
            if torch.allclose(values, mine, rtol=1e-5, atol=1e-6):
                return t.detach().reshape(-1), r
    return None


def sink_column(join: Record, by_index: dict[int, Record], n_head: int | None = None) -> torch.Tensor | None:
    """Where `join` appends (or prepends) a column of one value a head for every query row to the scores on its last
    axis: those values `[n_head]`; None otherwise."""
    parts = [by_index[p] for p in join.parents if p in by_index]
    tensor = join.tensor
    if len(parts) != 2 or tensor.dim() < 3 or not tensor.is_floating_point():
        return None
    widths = [int(p.tensor.shape[-1]) if p.tensor.dim() == tensor.dim() else -1 for p in parts]
    if sorted(widths)[0] != 1 or sum(widths) != int(tensor.shape[-1]) or widths[0] == widths[1]:
        return None
    column = parts[widths.index(1)].tensor[..., 0].detach()  # [.., n_head, n_Q]
    # the heads on one axis, else on the last few before the queries' (GPT-OSS's reference `S.reshape(n_kv_head,
    # q_mult, 1, 1)`: a KV head's group of query heads on an axis of its own), the fewest axes that hold them
    leading = column.shape[:-1]
    for k in range(1, len(leading) + 1):
        heads = math.prod(leading[-k:])
        if n_head is not None and heads != n_head:
            continue
        per_head = column.reshape(*leading[:-k], heads, column.shape[-1]).movedim(-2, 0).reshape(heads, -1)
        if torch.equal(per_head, per_head[:, :1].expand_as(per_head)):
            return per_head[:, 0]
        if n_head is not None:
            return None
    return None


def joined_at(softmax: Record, records: list[Record]) -> int | None:
    """The position of the sink column in what `softmax` weighs (its last axis), where its input joins one: -1 or
    0; None otherwise."""
    from attnscope.usertrace.align import ancestors

    by_index = {r.index: r for r in records}
    above = ancestors(softmax, records)
    for r in records:
        if r.index in above and r.func.split(".")[-1] in JOINS:
            column = sink_column(r, by_index)
            if column is not None:
                first = by_index[r.parents[0]] if r.parents and r.parents[0] in by_index else None
                return 0 if first is not None and first.tensor.dim() == r.tensor.dim() \
                    and int(first.tensor.shape[-1]) == 1 else -1
    return None


def note(join: Record, n_head: int) -> str:
    return (f"attention sinks: your code joins one logit a head of its own ({n_head}, a tensor your module holds) to "
            f"each row of its scores as one more column before the softmax and drops it after (line {join.line}; "
            "GPT-OSS's sinks), so a row may put part of its weight on nothing: read as its convention, and the "
            "reference holds your module's sinks")


def _softmaxed(join: Record, records: list[Record]) -> bool:
    """Whether a softmax reads `join` (through the ops after it: the row's maximum taken out)."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.record import SOFTMAXES

    return any(r.func.split(".")[-1] in SOFTMAXES and join.index in ancestors(r, records) for r in records
               if r.index > join.index)
