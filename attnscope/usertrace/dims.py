"""Named dims for every recorded tensor, where the sizes allow it.

Sizes alone name most axes (sizes.py). Where two dims share a size (self-attention's n_Q = n_K), an axis is
named from where the tensor comes from:
- a tensor lined up with a reference step takes that step's dims, in the layout it holds them;
- any other takes its parents' (or, failing those, its children's): a transpose or permute moves their names
  with the axes (found by the numbers: the permutation of the parent that gives this tensor), an elementwise
  op or a view keeps the names
  of the axes whose sizes it keeps (counted from the left, then from the right), a matmul takes its rows from
  the left operand and its columns from the right one;
- the last resort is the place: `[.., n_Q, n_K]` for the two last axes of a score-like tensor.
An axis none of these settles keeps every candidate (`n_Q|n_K`); none is guessed.
"""

from __future__ import annotations

from itertools import permutations
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from attnscope.usertrace.lined import Aligned
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.sizes import AxisNames

MATMULS = ("matmul", "__matmul__", "bmm", "mm", "einsum")
VIEWS = ("view", "reshape", "_unsafe_view", "unflatten", "unsqueeze")
HEAD_WIDTHS = ("d_head", "d_K", "d_V", "d_Q")
Dims = tuple[str, ...]


def _grouped(dims: Dims, shape: torch.Size, names: AxisNames) -> Dims:
    """A dim named twice by size where n_group has that size (n_kv_head = n_group = 2: q viewed [.., n_kv_head,
    n_group, ..]): both axes keep both candidates, `n_kv_head|n_group`, for where they come from to settle."""
    group = names.extra.get("n_group")
    plain = [d for d in dims if "|" not in d]
    twice = {d for d in plain if plain.count(d) > 1}
    if not group or not twice:
        return dims
    return tuple(f"{d}|n_group" if d in twice and int(n) == group else d for d, n in zip(dims, shape, strict=True))


def name_records(records: list[Record], rows: list[Aligned], names: AxisNames,
                 inputs: dict[str, tuple[Dims, torch.Tensor]]) -> dict[int, Dims]:
    """record index -> its dims. `inputs`: how the ops name each input -> its dims (the queries' axis n_Q,
    the keys' n_K) and tensor."""
    resolved: dict[int, Dims] = {}
    for row in rows:
        if row.record is None or row.status not in ("equal", "permuted"):
            continue
        held = resolved.get(row.record.index)
        if held is not None and len(set(held)) == len(held):
            continue
        found = _from_step(row.dims, tuple(row.shape), tuple(row.record.tensor.shape), row.order, row.merged,
                           row.split)
        if found is not None and (held is None or len(set(found)) == len(found)):
            # a later step's names where the first one's split an axis in two of one name (Q_feat's d_feat as
            # [d_feat, d_feat] on Keras' [n_batch, n_Q, n_head, d_head], which Q_split names)
            resolved[row.record.index] = found
    out: dict[int, Dims] = {}
    for record in records:
        dims = resolved.get(record.index) or _grouped(names.dims(record.tensor.shape), record.tensor.shape, names)
        sources = [(out[p], records[p].tensor) for p in record.parents if p in out]
        sources += [inputs[a[1]] for a in record.args if a[0] == "text" and a[1] in inputs]
        if record.index not in resolved and record.func in VIEWS and len(sources) == 1:
            dims = _viewed(dims, tuple(record.tensor.shape), *sources[0])
        if any("|" in d for d in dims):
            dims = _from_parents(record, dims, sources)
        out[record.index] = dims
    for record in reversed(records):  # and back from the children: the view a transpose of it was lined up
        if not any("|" in d for d in out[record.index]):
            continue
        named = list(out[record.index])
        for child in records[record.index + 1:]:
            if record.index not in child.parents:
                continue
            rank = record.tensor.dim()
            if child.tensor.dim() >= rank and all(  # an elementwise op keeps the axes, broadcast from the right
                    child.tensor.shape[-i] == record.tensor.shape[-i] for i in range(1, rank + 1)):
                for i in range(1, rank + 1):
                    _settle(named, -i, out[child.index][-i])
                continue
            order = permutation(record.tensor, child.tensor)
            if order is not None:
                for axis, source in enumerate(order):
                    _settle(named, source, out[child.index][axis])
        out[record.index] = tuple(named)
    return out


def _viewed(dims: Dims, shape: tuple[int, ...], parent_dims: Dims, parent: torch.Tensor) -> Dims:
    """A view's dims from its parent's where sizes alone would name them by coincidence: the same sizes but for
    axes of 1 (gpt-fast's `freqs_cis.view(1, n, 1, d / 2, 2)` of `[n, d_head/2, 2]`) keep the parent's names; a
    head's width cut into its rotary pairs (`x.reshape(*x.shape[:-1], -1, 2)`, Meta's and gpt-fast's) is
    `d_head/2, 2`, or `2, d_head/2` for the halves, never a product of head counts that happens to be as wide."""
    if len(parent_dims) != parent.dim():
        return dims
    kept = [i for i, n in enumerate(shape) if n != 1]
    held = [i for i, n in enumerate(parent.shape) if n != 1]
    if len(shape) > parent.dim() and [shape[i] for i in kept] == [parent.shape[i] for i in held]:
        named = ["1"] * len(shape)
        for i, j in zip(kept, held, strict=True):
            named[i] = parent_dims[j]
        return tuple(named) if all(d and "|" not in d for d in named) else dims
    width, last = int(parent.shape[-1]) if parent.dim() else 0, parent_dims[-1] if parent_dims else ""
    if len(shape) == parent.dim() + 1 and tuple(shape[:-2]) == tuple(parent.shape[:-1]) and width % 2 == 0 \
            and last in HEAD_WIDTHS and tuple(shape[-2:]) in ((width // 2, 2), (2, width // 2)):
        pair = (f"{last}/2", "2") if shape[-1] == 2 else ("2", f"{last}/2")
        return (*parent_dims[:-1], *pair)
    return dims


def _from_step(dims: Dims, shape: tuple[int, ...], user_shape: tuple[int, ...], order: tuple[int, ...] | None,
               merged: bool, split: tuple[int, int, int] | None = None) -> Dims | None:
    if order is None:
        return None
    if split is not None:  # one axis viewed as two (n_head as n_kv_head, n_group)
        axis, a, b = split
        parts = ("n_kv_head", "n_group") if dims[axis] == "n_head" else (dims[axis], dims[axis])
        dims = (*dims[:axis], *parts, *dims[axis + 1:])
        shape = (*shape[:axis], a, b, *shape[axis + 1:])
    permuted = [dims[i] for i in order]
    if not merged:
        return tuple(permuted)
    sizes = [shape[i] for i in order]
    out: list[str] = []
    i = 0
    for size in user_shape:
        group: list[str] = []
        product = 1
        while i < len(sizes) and (product < size or (sizes[i] == 1 and product == size and not group)):
            group.append(permuted[i])
            product *= sizes[i]
            i += 1
        if product != size:
            return None
        out.append("·".join(g for g in group if g) if group else "1")
    return tuple(out) if i == len(sizes) else None


def _from_parents(record: Record, dims: Dims, sources: list[tuple[Dims, torch.Tensor]]) -> Dims:
    named = list(dims)
    if record.func in MATMULS and len(sources) >= 2 and record.tensor.dim() >= 2:
        left, right = sources[0][0], sources[1][0]
        _settle(named, -2, left[-2] if len(left) >= 2 else None)
        _settle(named, -1, right[-1])
        for axis in range(-3, -record.tensor.dim() - 1, -1):
            _settle(named, axis, left[axis] if len(left) >= -axis else None)
    for parent_dims, parent in sources:
        if not any("|" in d for d in named):
            break
        order = permutation(parent, record.tensor)
        if order is not None:
            for axis, source in enumerate(order):
                _settle(named, axis, parent_dims[source])
            continue
        if record.func in ("view", "reshape", "flatten", "_unsafe_view") and record.tensor.dim() < parent.dim() \
                and not any("|" in d for d in parent_dims):  # neighbours merged: their names joined, in order
            joined = _from_step(parent_dims, tuple(parent.shape), tuple(record.tensor.shape),
                                tuple(range(parent.dim())), True)
            if joined is not None:
                named = [n if "|" not in n else j for n, j in zip(named, joined, strict=True)]
                continue
        same = min(len(parent_dims), record.tensor.dim())
        for side in (1, -1):  # the axes a view or an elementwise op keeps, from the left, then from the right
            for k in range(same):
                axis = k if side == 1 else -1 - k
                if parent.shape[axis] != record.tensor.shape[axis]:
                    break
                _settle(named, axis, parent_dims[axis])
    if len(named) >= 2 and _is(named[-2], "n_Q") and _is(named[-1], "n_K"):
        named[-2], named[-1] = "n_Q", "n_K"  # [.., n_Q, n_K]: where scores keep their queries and keys
    return tuple(named)


def _settle(named: list[str], axis: int, name: str | None) -> None:
    """Give an ambiguous axis the parent's name, when that name is one of its candidates."""
    if name is not None and "|" in named[axis] and "|" not in name and name in named[axis].split("|"):
        named[axis] = name


def _is(name: str, candidate: str) -> bool:
    return candidate in name.split("|")


def permutation(parent: torch.Tensor, tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The axis order of `parent` that gives `tensor` (a transpose, a permute, .T), found by the numbers;
    None when it is not one, or when the identity would do (the names then follow by position)."""
    if parent.dim() != tensor.dim() or parent.dim() > 5 or parent.shape == tensor.shape and torch.equal(parent, tensor):
        return None
    if sorted(parent.shape) != sorted(tensor.shape):
        return None
    for order in permutations(range(parent.dim())):
        if tuple(parent.shape[i] for i in order) == tuple(tensor.shape):
            try:
                if torch.equal(parent.permute(order), tensor):  # [parent.shape[i] for i in order], tensor's shape
                    return order
            except RuntimeError:
                return None
    return None
