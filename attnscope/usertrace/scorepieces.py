"""Which tensors of the run are pieces of the reference's steps of the heads, and which products are pieces of its
scores (gathered.py lines the pieces up).

A tensor whose rows (its last axis, d_head wide) are each one row of a reference step of the heads, up to one common
positive factor (`rows_of`), gives each of its rows the (batch, head, token) it stands for. A product of two such
tensors (`q @ kᵀ`, a bmm, an einsum paired by its equation, F.scaled_dot_product_attention's scores recomputed)
whose every cell pairs the queries and keys of one batch element and head is a piece of the scores (`scores_piece`),
each cell the reference's (b, h, i, j); so is what joins such pieces along the keys' axis (`joined`: torch.cat)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from attnscope.usertrace.align import layouts, tolerance

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record

QUERIES, KEYS = ("Q_split", "Q_normed", "Q_rot"), ("K_split", "K_normed", "K_rot", "K_rep")
MATMUL_FUNCS = ("matmul", "__matmul__", "bmm", "einsum")
# a product read anew in its own order (`(q.unsqueeze(-2) @ k_near.mT).squeeze(-2)`: a row of one per query)
VIEWS = ("view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze")
MAX_ROWS = 2048  # a step's rows compared with each other once: n_batch · n_head · n at most


class Step:
    """A reference step of the heads `[n_batch, n_head, n, d]`, its rows as unit vectors, whether they differ."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape = tuple(tensor.shape)
        self.d = int(tensor.shape[-1])
        self.rows = tensor.detach().double().reshape(-1, self.d)
        self.norms = self.rows.norm(dim=1)
        self.tol = tolerance(tensor)
        self.unit = self.rows / self.norms.clamp_min(1e-300)[:, None]
        # two rows alike (or of zeros): which row a piece's row stands for cannot be read
        apart = torch.cdist(self.unit, self.unit) + 2 * torch.eye(len(self.rows), dtype=self.rows.dtype)
        self.distinct = bool((self.norms > 0).all()) and bool(apart.min() > 1e-3)


def rows_of(tensor: torch.Tensor, steps: dict[str, Step]) -> tuple[str, torch.Tensor, bool] | None:
    """(the step, each row's flat position over its [b, h, n] rows, whether the rows are the tensor's columns) where
    every row of `tensor` (or of its last two axes swapped) is one row of a step of the heads times one common
    positive factor; None otherwise."""
    if not tensor.is_floating_point() or tensor.dim() < 2 or tensor.numel() == 0:
        return None
    for turned in (False, True):
        t = tensor.transpose(-1, -2) if turned else tensor
        for name, step in steps.items():
            if t.shape[-1] != step.d:  # (a square [d, d] both ways round: the values tell)
                continue
            rows = _matched(t.detach().double().reshape(-1, step.d), step)
            if rows is not None:
                return name, rows.reshape(t.shape[:-1]), turned
    return None


def _matched(user: torch.Tensor, step: Step) -> torch.Tensor | None:
    """For each of `user`'s rows, the one of the step's rows it is (times one common positive factor); None where a
    row is none of them."""
    if user.shape[0] > 4 * MAX_ROWS:
        return None
    norms = user.norm(dim=1)
    if bool((norms == 0).any()):
        return None
    distance, rows = torch.cdist(user / norms[:, None], step.unit).min(dim=1)
    if float(distance.max()) > 1e-4:
        return None
    factor = float((norms / step.norms[rows]).median())
    if factor <= 0 or float((user - factor * step.rows[rows]).abs().max()) > step.tol * max(factor, 1.0) * 4:
        return None
    return rows


def scores_piece(record: Record, records: list[Record], maps: dict[int, tuple[str, torch.Tensor, bool] | None],
                  steps: dict[str, Step], keys: tuple[str, ...] = KEYS) -> tuple[tuple[int, ...], torch.Tensor] | None:
    """(the scores' shape, each cell's flat position in it) where `record` multiplies a piece of the queries by one
    of the keys (of a step of `keys`) and every sequence pairs one batch element's and head's; None otherwise."""
    given = operands_of(record)
    if len(given) != 2:
        return None
    for g in given:
        if g not in maps:
            maps[g] = rows_of(records[g].tensor, steps)
    left, right = maps[given[0]], maps[given[1]]
    if left is None or right is None:
        return None
    (q_name, q_rows, q_turned), (k_name, k_rows, _) = left, right
    if q_name not in QUERIES or k_name not in keys or q_turned:
        return None
    n_q, n_k = steps[q_name].shape[-2], steps[k_name].shape[-2]
    if steps[q_name].shape[:2] != steps[k_name].shape[:2]:
        return None
    out = record.tensor
    paired = _einsum_cells(record, q_rows, k_rows)
    if paired is not None:  # an einsum that broadcasts one side (Pegasus-X's 'BHNKF,BHGF->BHNKG')
        q_rows, k_rows = paired
    else:
        if out.dim() < 2 or tuple(out.shape[-2:]) != (q_rows.shape[-1], k_rows.shape[-1]):
            return None
        try:
            q_rows, k_rows = q_rows[..., :, None], k_rows[..., None, :]
            q_rows, k_rows = torch.broadcast_tensors(q_rows, k_rows)
        except RuntimeError:
            return None
    if tuple(q_rows.shape) != tuple(out.shape) or not bool((q_rows // n_q == k_rows // n_k).all()):
        return None
    shape = (*steps[q_name].shape[:3], n_k)
    if layouts(shape, tuple(out.shape)):
        return None
    return shape, q_rows * n_k + k_rows % n_k


def _einsum_cells(record: Record, q_rows: torch.Tensor, k_rows: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each cell's query row and key row, laid out as an einsum's output (`'BHNKF,BHGF->BHNKG'`: the block queries
    against keys shared by every block), where `record` is an einsum contracting the last label of both operands;
    None otherwise (a matmul: its last two axes pair them)."""
    eq = next((v for kind, v in record.args if kind == "text" and isinstance(v, str) and "->" in v), None)
    if record.func.split(".")[-1] != "einsum" or eq is None or "..." in eq:
        return None
    ins, out = eq.replace(" ", "").strip("'\"").split("->")  # the equation as records write it, quoted
    sides = ins.split(",")
    if len(sides) != 2 or not sides[0] or sides[0][-1] != sides[1][-1] or sides[0][-1] in out:
        return None

    def laid(rows: torch.Tensor, labels: str) -> torch.Tensor | None:
        if rows.dim() != len(labels) or set(labels) - set(out) or len(set(labels)) != len(labels):
            return None
        moved = rows.permute([labels.index(c) for c in out if c in labels])
        return moved.reshape([rows.shape[labels.index(c)] if c in labels else 1 for c in out])

    q, k = laid(q_rows, sides[0][:-1]), laid(k_rows, sides[1][:-1])
    if q is None or k is None:
        return None
    try:
        return torch.broadcast_tensors(q, k)  # type: ignore[return-value]
    except RuntimeError:
        return None


def joined(record: Record, parts: dict[int, tuple[tuple[int, ...], torch.Tensor]]
            ) -> tuple[tuple[int, ...], torch.Tensor] | None:
    """(the scores' shape, each cell's flat position in it) where `record` joins pieces of the scores (`parts`) along
    its last axis, the keys' (`torch.cat([local2global, local2local], dim=-1)`), each cell once; None otherwise."""
    import re

    listed = next((value for kind, value in record.args if kind == "list"), None)
    dims = [int(m.group(1)) for kind, value in record.args if kind == "text" and isinstance(value, str)
            and (m := re.fullmatch(r"(?:dim=)?(-?\d+)", value.strip()))]
    t = record.tensor
    if not listed or len(dims) != 1 or dims[0] not in (-1, t.dim() - 1) or any(k != "rec" for k, _ in listed):
        return None
    joined = [parts.get(i) for _, i in listed]
    if any(j is None for j in joined) or len({j[0] for j in joined if j is not None}) != 1:
        return None
    index = torch.cat([j[1] for j in joined if j is not None], dim=-1)
    rows = index.reshape(-1, index.shape[-1]).sort(dim=-1).values
    if tuple(index.shape) != tuple(t.shape) or bool((rows[:, 1:] == rows[:, :-1]).any()):
        return None
    first = joined[0]
    assert first is not None
    return first[0], index


def is_product(record: Record) -> bool:
    """Whether `record` is a product of two operands, or the scores a kernel computes without materializing them
    (F.scaled_dot_product_attention's, recomputed: kernels.py)."""
    return record.func.split(".")[-1] in MATMUL_FUNCS \
        or (record.func == "recomputed" and record.names[:1] == ["(scores)"])


def operands_of(record: Record) -> list[int]:
    """The records a product reads, in order: a recomputed kernel's scores read the kernel's query and key (its
    first two parents)."""
    from attnscope.usertrace.flow import records_read

    return list(record.parents[:2]) if record.func == "recomputed" else records_read(record)


def unlaid(record: Record, scores: tuple[int, ...] | None) -> bool:
    """Whether `record` is a product smaller than the scores `scores` and in no layout of them: a piece of the scores
    whose operands may be layouts of the steps, not pieces, where its batch axes pair each group's queries with its
    own keys (Hiera's mask units beside pooled queries, `[B, heads, units, q, d] @ [B, heads, units, d, k]`): an axis
    more than the scores have (groups moved into the batch axis, `[B·W, heads, h, h]`, are regroup.py's)."""
    return scores is not None and is_product(record) and record.tensor.dim() > len(scores) \
        and record.tensor.numel() < math.prod(scores) and not layouts(scores, tuple(record.tensor.shape))
