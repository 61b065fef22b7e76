"""Which axis of the code's scores holds the keys, read from the data flow, never from the shape: in the product
that makes the scores (`Qᵀ K`, `K.T @ Q`, `einsum("bhdq,bhdk->bhqk", q, k)`), the axis each operand keeps is indexed
by that operand's tokens, and the operand computed from the keys (the key input, or the key projection's weight)
gives the keys' axis. The axes are followed from the product through the ops that keep them (a scale, a mask, the
softmax, a transpose, a view that keeps the last two axes) to the product with the values.

Square scores (n_Q = n_K) then line up in either orientation: the column form's textbooks write `Kᵀ Q` [n_K, n_Q]
(Phuong & Hutter) and `Qᵀ K` [n_Q, n_K] alike. An orientation is read only where the code uses it consistently:
the product with the values contracts the pattern over the keys' axis. Code that contracts it over the queries'
(`K Qᵀ` softmaxed and multiplied as if it were `Q Kᵀ`) has its scores transposed, a mistake the line-up reports.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from attnscope.usertrace.record import MATMULS, SOFTMAXES

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record

# ops that move axes; those that keep every axis in place are read off the shapes (elementwise, softmax, masks)
MOVES = ("transpose", "swapaxes", "swapdims", "mT", "T", "t", "permute", "movedim")
PRODUCTS = (*MATMULS, "einsum")
KERNEL_STEPS = {"(scores)", "(masked_scores)", "(attention)"}  # a kernel's recomputed steps of [.., n_Q, n_K]
RECORD = "record "  # an origin that is one of the code's tensors (lined_roles), no input's or weight's label
Labels = tuple[str | None, ...]  # per axis of a tensor: "q", "k", or None


def key_axes(records: list[Record], query: Iterable[str], key: Iterable[str]) -> dict[int, int]:
    """Record index -> the axis holding the keys (-1 or -2), for each tensor that holds the scores, or a tensor
    made from them axis by axis, with the queries and the keys on its last two axes; `query` and `key` name what
    the queries and the keys are computed from (the inputs' labels, the projections' names). Empty where the data
    flow says nothing (no product of the two, a fused kernel) or where the code contracts the pattern with the
    values over the queries' axis."""
    query, key = set(query), set(key)
    # what a fused kernel recomputes (kernels.py: SDPA's scores and weights, never materialized) is `Q Kᵀ`, the keys
    # last, whatever form the code around it takes (column-form code that lays its heads as rows for the kernel)
    found: dict[int, int] = {r.index: -1 for r in records if r.style == "recomputed" and KERNEL_STEPS & set(r.names)}
    if not query or not key or query & key:
        return found
    origins = _origins(records)
    by_index = {r.index: r for r in records}
    for softmax in (r for r in records if r.func.split(".")[-1] in SOFTMAXES):
        product = product_above(softmax, by_index)
        if product is None:
            continue
        labels = _product_labels(product, origins, query, key)
        if labels is None:
            continue
        followed = _follow(records, product, labels)
        if followed is None:
            continue
        for index, held in followed.items():
            if len(held) >= 2 and set(held[-2:]) == {"q", "k"}:
                found[index] = -1 if held[-1] == "k" else -2
    return found


def lined_roles(rows: Iterable[object]) -> tuple[set[str], set[str]]:
    """What the code's queries and keys are, where their projection cannot say (rows of one fused weight make both:
    guided-diffusion's `qkv` conv, split per head): the code's tensors the line-up found equal to the queries and the
    keys (`rows`: lineup.Aligned, the reference's Q and K steps lined up before any axis of the scores was read)."""
    found: dict[str, set[str]] = {"Q": set(), "K": set()}
    for row in rows:
        step, record = getattr(row, "reference", ""), getattr(row, "record", None)
        role = step.split("_")[0]
        if role in found and step.endswith(("_feat", "_split")) and record is not None \
                and getattr(row, "status", "") in ("equal", "permuted"):
            found[role].add(f"{RECORD}{record.index}")
    return found["Q"], found["K"]


def turned(keys: dict[int, int], dims: tuple[str, ...]) -> frozenset[int]:
    """The records of `keys` that hold a step of `dims` (queries and keys its last two axes) with those two axes
    the other way round: the step's layout with them swapped is theirs."""
    if len(dims) < 2 or set(dims[-2:]) != {"n_Q", "n_K"}:
        return frozenset()
    at = -1 if dims[-1] == "n_K" else -2
    return frozenset(index for index, axis in keys.items() if axis != at)


def keys_last(keys: dict[int, int]) -> bool | None:
    """Whether the code's scores hold the keys on their last axis (`Qᵀ K`), as their first tensor says; None
    where the data flow says nothing."""
    return keys[min(keys)] == -1 if keys else None


def _origins(records: list[Record]) -> dict[int, set[str]]:
    """For each record, the labels of the inputs and weights it is computed from."""
    out: dict[int, set[str]] = {}
    for r in records:
        found = {str(v) for k, v in _read(r) if k == "text"} | {f"{RECORD}{r.index}"}
        for p in r.parents:
            found |= out.get(p, set())
        out[r.index] = found
    return out


def _read(record: Record) -> list[tuple[str, object]]:
    return [value[1] if kind == "kw" else (kind, value) for kind, value in record.args]


def product_above(softmax: Record, by_index: dict[int, Record]) -> Record | None:
    """The nearest product of two tensors the softmax is computed from (the scores'), through ops of one tensor
    argument or elementwise ones; None where there is none."""
    seen, todo = set(), list(softmax.parents)
    while todo:
        index = max(todo)
        todo.remove(index)
        if index in seen or index not in by_index:
            continue
        seen.add(index)
        r = by_index[index]
        if r.func.split(".")[-1] in PRODUCTS and r.style != "linear" and len(operands(r)) == 2:
            return r
        todo += list(r.parents)
    return None


def operands(r: Record) -> list[tuple[str, object]]:
    """The product's two tensor operands, as ("rec", index) or ("text", label)."""
    tensors = [(k, v) for k, v in _read(r) if k == "rec" or (k == "text" and not _literal(v))]
    if r.func.split(".")[-1] == "einsum":
        tensors = [(k, v) for k, v in tensors if not (k == "text" and "->" in str(v))]
    if r.func.split(".")[-1] == "baddbmm":
        tensors = tensors[1:]
    return tensors[-2:] if len(tensors) >= 2 else []


def _literal(value: object) -> bool:
    text = str(value)
    return "=" in text or text.startswith(("'", '"')) or bool(re.fullmatch(r"[-+0-9.e]+|inf|-inf|None", text))


def _role(operand: tuple[str, object], origins: dict[int, set[str]], query: set[str], key: set[str]) -> str | None:
    kind, value = operand
    came = {str(value)} if kind == "text" else origins.get(int(value), set())  # type: ignore[call-overload]
    is_q, is_k = bool(came & query), bool(came & key)
    return "q" if is_q and not is_k else "k" if is_k and not is_q else None


def _product_labels(product: Record, origins: dict[int, set[str]], query: set[str], key: set[str]) -> Labels | None:
    """The product's axes: the one each operand keeps labelled by its role; None where the roles are not one of
    each, or the kept axes cannot be read."""
    pair = operands(product)
    roles = [_role(o, origins, query, key) for o in pair]
    if sorted(r or "" for r in roles) != ["k", "q"]:
        return None
    rank = product.tensor.dim()
    if product.func.split(".")[-1] != "einsum":
        if rank < 2:
            return None
        return (*([None] * (rank - 2)), roles[0], roles[1])  # left's rows, right's columns
    spec = equation(product)
    if spec is None:
        return None
    ins, out = spec
    if len(ins) != 2 or len(out) != rank:
        return None
    labels: list[str | None] = []
    for letter in out:
        own = [i for i, sub in enumerate(ins) if letter in sub]
        labels.append(roles[own[0]] if len(own) == 1 else None)
    return tuple(labels)


def rows_from_right(r: Record) -> bool:
    """Whether a product of two operands is an einsum whose output's rows (its second-last axis) are the right
    operand's and its columns the left's (Keras' `einsum("aecd,abcd->acbe", key, query)`): the scores' query
    operand is then its second."""
    if r.func.split(".")[-1] != "einsum":
        return False
    spec = equation(r)
    if spec is None or len(spec[0]) != 2 or len(spec[1]) < 2:
        return False
    (left, right), out = spec
    row, column = out[-2], out[-1]
    return row in right and row not in left and column in left and column not in right


def equation(r: Record) -> tuple[list[str], str] | None:
    text = next((str(v) for k, v in _read(r) if k == "text" and "->" in str(v)), None)
    if text is None:
        return None
    left, out = text.strip("'\" ").replace(" ", "").split("->")
    if "." in left or "." in out:
        return None
    return left.split(","), out


def _follow(records: list[Record], product: Record, labels: Labels) -> dict[int, Labels] | None:
    """The labels of every tensor made from the product axis by axis, up to the product with the values; None
    where that product contracts the pattern over the queries' axis (the code's own reading of the axes is not
    the data flow's)."""
    held, contracted = walk(records, product, labels)
    return None if "q" in contracted.values() else held


def walk(records: list[Record], product: Record, labels: Labels) -> tuple[dict[int, Labels], dict[int, str | None]]:
    """The labels of every tensor made from the product axis by axis, and for each later product that reads one of
    them, the label of the axis it contracts."""
    held: dict[int, Labels] = {product.index: labels}
    contracted: dict[int, str | None] = {}
    by_index = {r.index: r for r in records}
    for r in records:
        if r.index <= product.index:
            continue
        parents = [p for p in r.parents if p in held]
        if not parents:
            continue
        name = r.func.split(".")[-1]
        if name in PRODUCTS:
            contracted[r.index] = _contracted(r, held)
            continue
        mine = _moved(r, held[parents[0]]) if name in MOVES else _kept(r, {p: held[p] for p in parents}, by_index)
        if mine is not None:
            held[r.index] = mine
    return held, contracted


def _contracted(r: Record, held: dict[int, Labels]) -> str | None:
    """The label of the axis a product contracts its labelled operand over."""
    pair = operands(r)
    for position, (kind, value) in enumerate(pair):
        if kind != "rec" or value not in held:
            continue
        labels = held[int(value)]  # type: ignore[call-overload]
        if r.func.split(".")[-1] != "einsum":
            return labels[-1] if position == 0 else labels[-2] if len(labels) >= 2 else None
        spec = equation(r)
        if spec is None or len(spec[0]) != 2 or len(spec[0][position]) != len(labels):
            return None
        gone = [labels[i] for i, letter in enumerate(spec[0][position]) if letter not in spec[1]]
        return next((g for g in gone if g is not None), None)
    return None


def _moved(r: Record, labels: Labels) -> Labels | None:
    """The labels after an op that moves axes."""
    rank = len(labels)
    name = r.func.split(".")[-1]
    numbers = [int(n) for k, v in _read(r)[1:] if k == "text" for n in re.findall(r"-?\d+", str(v).split("=")[-1])]
    order = list(range(rank))
    if name in ("mT", "t") or (name == "T" and rank == 2):
        order[-2:] = [rank - 1, rank - 2]
    elif name == "T":
        order = order[::-1]
    elif name in ("transpose", "swapaxes", "swapdims") and len(numbers) == 2:
        a, b = (n % rank for n in numbers)
        order[a], order[b] = b, a
    elif name == "permute" and len(numbers) == rank:
        order = [n % rank for n in numbers]
    elif name == "movedim" and len(numbers) == 2:
        a, b = (n % rank for n in numbers)
        moving = order.pop(a)
        order.insert(b, moving)
    else:
        return None
    if r.tensor.dim() != rank:
        return None
    return tuple(labels[i] for i in order)


def _kept(r: Record, held: dict[int, Labels], by_index: dict[int, Record]) -> Labels | None:
    """The labels of an op that keeps its input's axes where they are (a scale, a mask, the softmax, a view that
    keeps the last two axes): each labelled axis where the op's output has the same size there, counted from the
    end; None where two inputs disagree."""
    shape = tuple(r.tensor.shape)
    out: Labels | None = None
    for index, labels in held.items():
        theirs = tuple(by_index[index].tensor.shape)
        mine: list[str | None] = [None] * len(shape)
        for back in range(1, min(len(shape), len(theirs)) + 1):
            if shape[-back] != theirs[-back]:
                break
            mine[-back] = labels[-back]
        candidate = tuple(mine)
        if "q" not in candidate or "k" not in candidate:
            continue
        if out is not None and out != candidate:
            return None
        out = candidate
    return out
