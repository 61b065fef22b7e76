"""gqa.query_order: the query heads laid in another order than the checkpoint's before the scores read them (q viewed
`[B, n, n_group, n_kv_head, d]` where the checkpoint lays `[.., n_kv_head, n_group, ..]`, then flattened; a fused
per-group projection's query block moved group-first; q's heads indexed by an order of the code's own). The rerun
takes the reference's queries with their heads permuted, from the split on, and is named only where it gives the
code's tensors back. The orders tried: the two that map tiled and interleaved groups onto each other, and any order
read from the code's own tensors, a tensor of the queries' size whose heads are each one of the reference's.
heads.split_transposed: the queries' projection split (d_head, n_head) for (n_head, d_head), the heads' features
interleaved."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from attnscope.usertrace.align import layouts, tolerance
from attnscope.usertrace.rerun import Base, replay
from attnscope.usertrace.roperead import read_rope, rope_turn
from attnscope.usertrace.trials import Trial

# the queries' steps from the split on, the heads at -3 in the row form: what a permutation of the heads changes
STEPS = ("Q_split", "Q_normed", "Q_rot", "Q")


def trials_query_order(b: Base) -> Iterator[Trial]:
    """The reference's query heads permuted, each order once (not the identity), from the split on."""
    if b.q.dim() < 3 or b.q.shape[-3] < 2:  # no heads (a function's [n_batch, n, d] queries), or one
        return
    n_head = int(b.q.shape[-3])
    tried: set[tuple[int, ...]] = {tuple(range(n_head))}
    for order in (*_group_orders(b, n_head), *_read_orders(b, n_head)):
        if order in tried:
            continue
        tried.add(order)
        index = torch.tensor(order)
        steps = replay(b, q=b.q.index_select(-3, index))
        for name in STEPS:
            held = b.ref.get(name)
            if held is not None and held.dim() >= 3 and held.shape[-3] == n_head and name != b.names["q"]:
                steps[name] = held.index_select(-3, index)
        yield Trial(steps, _words(b, order))


def _group_orders(b: Base, n_head: int) -> list[tuple[int, ...]]:
    """The orders a wrong grouping lays the heads in: n_head read as [n_group, n_kv_head] where it is [n_kv_head,
    n_group], and the other way round."""
    n_kv = n_head // b.n_group
    if b.n_group < 2 or n_kv < 2:
        return []
    return [tuple(int(i) for i in torch.arange(n_head).view(a, c).t().reshape(-1))
            for a, c in ((b.n_group, n_kv), (n_kv, b.n_group))]


def _read_orders(b: Base, n_head: int) -> list[tuple[int, ...]]:
    """The orders the code's own tensors hold the queries' heads in: a tensor as large as a query step, laid out as
    it in some layout, whose every head is one of the reference's heads (each once) in another order."""
    found: list[tuple[int, ...]] = []
    for name in STEPS:
        ref = b.ref.get(name)
        if ref is None or ref.dim() != 4 or ref.shape[-3] != n_head:
            continue
        flat = torch.arange(ref.numel(), dtype=torch.float64).view(ref.shape)
        tol = tolerance(ref)
        for r in b.ctx.records:
            if r.tensor.numel() != ref.numel() or not r.tensor.is_floating_point():
                continue
            for layout in layouts(tuple(ref.shape), tuple(r.tensor.shape)):
                where = layout.apply(flat, tuple(r.tensor.shape)).reshape(-1).long()
                row = torch.empty(ref.numel(), dtype=torch.float64)
                row[where] = r.tensor.detach().double().reshape(-1)
                order = _heads(row.view(ref.shape), ref, tol)
                if order is not None and order not in found:
                    found.append(order)
    return found


def _heads(user: torch.Tensor, ref: torch.Tensor, tol: float) -> tuple[int, ...] | None:
    """For each head of `user` the reference's head it equals; None where one equals none, or two the same."""
    order = []
    for p in range(user.shape[-3]):
        diffs = [float((user[..., p, :, :] - ref[..., h, :, :]).abs().max()) for h in range(ref.shape[-3])]
        best = min(range(len(diffs)), key=diffs.__getitem__)
        if diffs[best] > tol or best in order:
            return None
        order.append(best)
    return tuple(order) if order != list(range(len(order))) else None


def trials_split_transposed(b: Base) -> Iterator[Trial]:
    """heads.split_transposed: the queries' projection [n_batch, n, n_head·d_head] split as (d_head, n_head) where
    the checkpoint lays (n_head, d_head) (`view(B, n, d, h).transpose(2, 3)`), then rotated where the reference
    rotates: each head made of every n_head-th feature."""
    feat, split = b.ref.get("Q_feat"), b.ref.get("Q_split")
    if b.kind != "module" or feat is None or split is None or split.dim() != 4 or feat.dim() != 3 \
            or b.names["q"] not in ("Q_split", "Q_rot") or b.col:
        return
    n_head, d_head = int(split.shape[-3]), int(split.shape[-1])
    if n_head < 2 or d_head < 2 or feat.shape[-1] != n_head * d_head:
        return
    viewed = feat.unflatten(-1, (d_head, n_head)).permute(0, 3, 1, 2)  # [n_batch, n_head, n, d_head]
    q = viewed
    if b.names["q"] == "Q_rot":
        rope = read_rope(b)
        if rope is None:
            return
        q = rope_turn(rope)(viewed, rope.q_pos)
    words = (f"query heads split the other way round: {{who}} is what the reference computes with the queries' "
             f"projection [n_batch, n, {n_head}·{d_head}] split as (d_head, n_head), view(.., {d_head}, {n_head}) "
             f"then the two swapped, where the checkpoint lays each head's {d_head} features together: (n_head, "
             f"d_head), view(.., {n_head}, {d_head}); each of your heads takes every {n_head}th feature")
    yield Trial({**replay(b, q=q), "Q_split": viewed}, words)


def _words(b: Base, order: tuple[int, ...]) -> str:
    said = ", ".join(str(h) for h in order)
    moved = ", ".join(f"your {p} is its {h}" for p, h in enumerate(order) if p != h)
    words = (f"query heads in another order: {{who}} is what the reference computes with the query heads taken in "
             f"the order {said} ({moved}), as your code splits or moves the queries' heads")
    g = b.n_group
    if g >= 2:
        n_kv = len(order) // g
        mine = "; ".join(f"key/value head {h} is read by the checkpoint's query heads "
                         f"{', '.join(str(i) for i in order[h * g:(h + 1) * g])}" for h in range(n_kv))
        words += (f": heads of one key/value group are not next to each other ({mine}; the checkpoint groups query "
                  f"heads h·{g} to h·{g} + {g - 1} on key/value head h)")
        if order in _group_orders(b, len(order)):
            outer = "n_group" if order[1] == n_kv else "n_kv_head"
            inner = "n_kv_head" if outer == "n_group" else "n_group"
            words += (f", as the heads viewed [.., {outer}, {inner}, ..] ({outer} outer), then moved and flattened, "
                      "lay them")
    return words + "; take q's heads as its projection lays them, [n_batch, n, n_head, d_head], in the checkpoint's " \
        "order"
