"""Where grouped-query code lays its key/value heads out, read from its data flow: the op on the keys' or values'
side that makes a tensor as wide as the query heads (K_rep's shape, in any order) from a narrower one, whatever
its form (`.repeat`, `repeat_interleave`, `expand` then `reshape` or `.contiguous().view`, a `torch.cat` or `stack`
of copies, an index). gqa.tiled and gqa.group_order compute the same numbers; where such an op exists the heads are
laid out on the keys' side, so the mistake is there (gqa.tiled, its words naming the op the code wrote), and where
none does the queries are grouped against unrepeated keys (gqa.group_order)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from attnscope.usertrace.record import Record
from attnscope.usertrace.rerun import Base
from attnscope.usertrace.trialreads import user_out

EXPANDS = ("expand", "expand_as", "broadcast_to")
# the repeats an op with no recorded input may be (what it repeats never said its size)
_REPEATS = ("repeat", "repeat_interleave", "expand", "index_select", "cat", "tile")


@dataclass(frozen=True)
class KVRepeat:
    """The code's key or value tensor as wide as the query heads (`made`), the op that widened it (`widened`:
    `made` itself, or before it through ops that keep its size) and `made`'s axis of the heads (-1 unknown)."""

    made: Record
    widened: Record
    heads: int


def kv_repeat(b: Base) -> KVRepeat | None:
    """The code's repeat of its keys or values for the query heads: a tensor of K_rep's shape the scores' keys or
    the pattern's values are made from, widened from fewer heads (a rotate_half's torch.cat of q is as wide, and
    on the queries' side alone); None where the code never widens its keys (a grouped einsum over q, a
    broadcasting matmul)."""
    if "K_rep" not in b.ref:
        return None
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.flow import operands

    target = user_out(b, "K_rep")
    shape, n_head = sorted(target.shape), int(target.shape[-3])
    records = b.ctx.records
    found = operands(records)
    # where the scores' operands are found, the repeat is what the keys or values are made from (a record made from
    # the pattern, the grouped einsum's output [n_batch, n_group, n_kv_head, n, d], is as wide, and no repeat)
    kv = None if found is None else set().union(*(ancestors(records[i], records) | {i} for i in found[1:3]))
    for r in records:
        if sorted(r.tensor.shape) != shape or (kv is not None and r.index not in kv):
            continue
        widened = _widened_at(r, records)
        if widened is not None:
            heads = [i for i, n in enumerate(r.tensor.shape) if n == n_head]
            return KVRepeat(r, widened, heads[0] if len(heads) == 1 else -1)
    return None


def _widened_at(r: Record, records: list[Record]) -> Record | None:
    """The op `r` was widened by: `r`, or an op before it through ops that keep its size (a view, a
    `.contiguous()`, a cast, RoPE on the repeated keys), whose inputs are all smaller than it; None where the walk
    meets an op of two inputs of its size, or one no larger input made."""
    size = r.tensor.numel()
    while True:
        given = [records[p].tensor.numel() for p in r.parents]
        if not given and "source_shape" in r.details:  # made from an input the code was handed (a function's k)
            given = [math.prod(r.details["source_shape"])]
        if not given:
            return r if r.func in _REPEATS else None
        if max(given) < size:
            return r
        same = [records[p] for p in r.parents if records[p].tensor.numel() == size]
        if len(same) != 1 or max(given) > size:
            return None
        r = same[0]


def tiled_words(b: Base, rep: KVRepeat | None) -> str:
    """gqa.tiled's words: the heads tiled as the code's own op lays them out (`rep`'s), where query head h reads
    key/value head h // n_group, and how to write that in the code's layout."""
    n_kv, g = int(b.k_new.shape[-3]), b.n_group
    axis = rep.heads if rep is not None and rep.heads >= 0 else 1
    dims = rep.made.tensor.dim() if rep is not None else 4
    tile = ", ".join(str(g) if i == axis else "1" for i in range(dims))
    how, also = f"as .repeat({tile}) does", ""
    op = rep.widened if rep is not None else None
    if op is not None and op.func not in ("repeat", "tile"):
        how = f"as your {_said(op)} (line {op.line}) lays them out"
        turned = _expanded(op, b.ctx.records, n_kv, g) if op.func in EXPANDS else None
        if turned is not None:
            have, want = turned
            how += f": {have} expanded, the {g} copies on a new axis before the heads' axis, then merged with it"
            also = f", or the new axis after the heads' ({want} expanded)"
    return (f"key/value heads repeated in the wrong order: {{who}} is what the reference computes with the {n_kv} "
            f"key/value heads tiled (0, 1, ..., 0, 1, ...), {how}, where query head h reads key/value head h // {g} "
            f"(0, 0, ..., 1, 1, ...): repeat_interleave({g}, dim={axis}){also}, as transformers' repeat_kv")


def _said(op: Record) -> str:
    if op.func == "__getitem__":
        return "index [...]"
    return f".{op.func}" if op.style == "method" else op.call


def _expanded(op: Record, records: list[Record], n_kv: int, g: int) -> tuple[list[int], list[int]] | None:
    """An expand's input shape, where its copies' axis (1 widened to n_group) stands right before the heads' (n_kv),
    and that input with the copies' axis after the heads' one; None where the shapes say otherwise."""
    given = list(records[op.parents[0]].tensor.shape) if op.parents else list(op.details.get("source_shape", ()))
    out = list(op.tensor.shape)
    if len(given) != len(out):
        return None
    copies = [i for i, (a, c) in enumerate(zip(given, out, strict=True)) if a == 1 and c == g]
    if len(copies) != 1 or copies[0] + 1 >= len(out) or given[copies[0] + 1] != n_kv:
        return None
    c = copies[0]
    return given, given[:c] + [n_kv, 1] + given[c + 2:]
