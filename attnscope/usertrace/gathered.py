"""Steps the code holds in pieces, each a gather of the reference's rows or cells: divided and grouped attention.

TimeSformer's divided space-time attention cuts the tokens after the projection into groups (frames for time
attention, patches for space attention), moves them into the batch axis (`(b h) (f n) d -> (b h n) f d`), prepends a
shared token's key and value to every group and attends within each; the shared token's query attends over all
tokens in a call of its own. Blocked or strided attention regroups the same way by `reshape` and `permute`, with or
without a shared token. Under the pattern given as --mask (each token sees its group and the shared token) this is
the reference's full attention, but no tensor of the code holds a reference step in a layout: its queries are
`[(b h g), m, d_head]` pieces, its scores `[(b h g), m, 1 + m]`.

The pieces are read from the values and the data flow, never from names or sizes: a tensor of the run whose rows
(its last axis, d_head wide) are each one row of a reference step of the heads (`Q_split`, `Q_rot`, `K_split`,
`V_split`, `x_raw`, up to one common factor: queries scaled early) gives each of its rows the (batch, head, token)
it stands for; a product of two such tensors (`q @ kᵀ`, an einsum) whose rows pair the queries and keys of one batch
element and head in every sequence is a piece of the scores, each cell the reference's (b, h, i, j), and so are the
tensors made from it elementwise (masked, softmaxed), where the code normalizes it whole (a softmax over it: each
query's keys all in it; online softmax's blocks of keys are none). A step is lined up with its pieces where the step
gathered at their rows or cells equals them and together they hold every query's row (`best_equal`); a piece that
differs is never paired, so the step is left to the usual line-up and its diagnosis.

Which tensors and products are pieces is scorepieces.py's. What else reads the pieces: the catalog's softmax over the
queries within each piece and any entry made in some of the pieces alone (piecetrials.py); groups with no shared
token, read as the code's convention without a --mask (`grouping`, regroup.read); units whose queries are not their
keys, read as a mask (`pattern`, unitmask.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnscope.usertrace.align import Layout, Match, ancestors, difference, layouts, tolerance
from attnscope.usertrace.record import SOFTMAXES
from attnscope.usertrace.scorepieces import (
    KEYS,
    MAX_ROWS,
    QUERIES,
    VIEWS,
    Step,
    is_product,
    joined,
    operands_of,
    rows_of,
    scores_piece,
    unlaid,
)

if TYPE_CHECKING:
    from attnscope.trace import Trace
    from attnscope.usertrace.record import Record

# the reference's steps of the heads, [n_batch, n_head, n, d], whose rows a piece's rows may be
HEAD_STEPS = ("Q_split", "Q_normed", "Q_rot", "K_split", "K_normed", "K_rot", "K_rep", "V_split", "V_rep", "x_raw")
REDUCTIONS = ("max", "amax", "min", "amin", "sum", "mean", "logsumexp", "norm")


@dataclass
class Gathered(Layout):
    """A layout that gathers: the user's tensor is the reference's values at `index` (flat positions in the
    reference, the user's shape), `what` says which rows or cells."""

    index: torch.Tensor | None = None
    what: str = ""

    def describe(self, dims: tuple[str, ...], shape: tuple[int, ...]) -> str:
        return f"gathered: {self.what}"

    def apply(self, reference: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        assert self.index is not None
        return reference.reshape(-1)[self.index.reshape(-1)].reshape(shape)

    def undo(self, user: torch.Tensor, reference_shape: tuple[int, ...]) -> torch.Tensor:
        """The user's values where they stand in the reference, NaN where the piece holds none."""
        assert self.index is not None
        out = torch.full(reference_shape, float("nan"), dtype=user.dtype).reshape(-1)
        out[self.index.reshape(-1)] = user.reshape(-1)
        return out.reshape(reference_shape)


Gathers = dict[int, dict[tuple[int, ...], tuple[torch.Tensor, str]]]  # record -> reference shape -> (index, words)


def read(trace: Trace, records: list[Record]) -> Gathers:
    """The code's pieces of the reference's steps: for each record that holds no step in a layout yet gathers one,
    the flat positions in the step (by the step's shape) of its values."""
    return _scan(trace, records)[0]


def score_pieces(trace: Trace, records: list[Record], keys: tuple[str, ...] = KEYS
                 ) -> list[tuple[Record, torch.Tensor]]:
    """The code's products of a piece of the queries and one of the keys (its scores in pieces), each with the flat
    positions of its cells in the reference's scores; `keys`, the steps that may stand as the keys (the values' too,
    to place cells where the code took its keys from its values)."""
    return _scan(trace, records, keys)[1]


def grouping(trace: Trace, records: list[Record]) -> tuple[torch.Tensor, int, int, Record] | None:
    """The groups the code attends within, where it cuts its queries, keys and values into them after the projection
    and moves them into the batch axis, no token shared (`[b·groups, heads, m, d_head]`, `[(b h groups), m,
    d_head]`): (each group's tokens, flat `b · n + t`, `[n_batch·groups, m]`; n_batch; n; the queries its first piece of
    the scores reads),
    read from which queries and keys each piece of its scores pairs; None where a piece's keys are not its queries
    (a shared token: the --mask route) or the groups differ between heads."""
    pieces = score_pieces(trace, records)
    if not pieces:
        return None
    n_batch, n_head, n, n_k = trace["scores"].shape if "scores" in trace else (0, 0, 0, 0)
    if n != n_k or n == 0:
        return None
    found: dict[tuple[int, int], set[tuple[int, ...]]] = {}
    for _, index in pieces:
        cells = index.reshape(-1, *index.shape[-2:])  # [sequences, m, k]
        queries, keys = _queries(cells, n), cells[:, 0, :] % n  # flat (b, h, i) of each query; each key's token
        for q, k in zip(queries.tolist(), keys.tolist(), strict=True):
            tokens = tuple(i % n for i in q)
            if sorted(tokens) != sorted(k) or len(set(tokens)) != len(tokens):
                return None
            found.setdefault((q[0] // n // n_head, q[0] // n % n_head), set()).add(tuple(sorted(tokens)))
    per_head = {key: frozenset(groups) for key, groups in found.items()}
    if len(per_head) != n_batch * n_head or len({groups for groups in per_head.values()}) != 1:
        return None
    groups = sorted(next(iter(per_head.values())))
    if sorted(t for g in groups for t in g) != list(range(n)) or len({len(g) for g in groups}) != 1 or len(groups) < 2:
        return None

    index = flat_groups(torch.tensor(groups).expand(n_batch, -1, -1), n)
    return index, n_batch, n, records[operands_of(pieces[0][0])[0]]


def pattern(trace: Trace, records: list[Record]) -> tuple[torch.Tensor, Record] | None:
    """The mask the code's pieces of the scores make, where each query's keys are some of them alone (mask units
    beside pooled queries: a unit's queries against its own keys): (True where a piece pairs a query with a key,
    `[n_batch, n_Q, n_K]`, the same in every head; the first piece); None where a query is in two pieces or in none,
    the heads differ, or every query meets every key."""
    pieces = score_pieces(trace, records)
    if not pieces or "scores" not in trace:
        return None
    shape = tuple(trace["scores"].shape)
    if piece_queries(pieces, shape) is None:
        return None
    held = torch.zeros(math.prod(shape), dtype=torch.bool)
    for _, index in pieces:
        held[index.reshape(-1)] = True
    held = held.reshape(shape)
    if bool(held.all()) or not bool(held.any(-1).all()) or bool((held != held[:, :1]).any()):
        return None
    return held[:, 0], pieces[0][0]


def flat_groups(tokens: torch.Tensor, n: int) -> torch.Tensor:
    """Each group's tokens `[n_batch, n_group, .., n_in_group]` (a token t of n in its sequence) flat over the
    batch, `b · n + t`, `[n_batch·n_group, n_in_group]`: regroup.Grouping's index."""
    offset = torch.arange(tokens.shape[0]).reshape(-1, *[1] * (tokens.dim() - 1)) * n
    return (tokens + offset).reshape(tokens.shape[0] * tokens.shape[1], -1)


def _scan(trace: Trace, records: list[Record], keys: tuple[str, ...] = KEYS
          ) -> tuple[Gathers, list[tuple[Record, torch.Tensor]]]:
    shapes = {name: tuple(trace[name].shape) for name in HEAD_STEPS if name in trace and trace[name].dim() == 4
              and trace[name].shape[0] * trace[name].shape[1] * trace[name].shape[2] <= MAX_ROWS}
    if not any(n in shapes for n in QUERIES) or not any(n in shapes for n in keys):
        return {}, []
    # the tensors that may be pieces: of a step's width, in no layout of it (the common run has none: nothing more)
    candidates = [r for r in records if r.tensor.is_floating_point() and r.tensor.dim() >= 2 and any(
        r.tensor.shape[-1] == shape[-1] and not layouts(shape, tuple(r.tensor.shape)) for shape in shapes.values())]
    scores = tuple(trace["scores"].shape) if "scores" in trace else None
    if not candidates and not any(unlaid(record, scores) for record in records):
        return {}, []
    steps = {name: step for name in shapes if (step := Step(trace[name])).distinct}
    maps: dict[int, tuple[str, torch.Tensor, bool] | None] = {}  # record -> (step, flat row over [b, h, n], turned)
    out: Gathers = {}
    neighbours = False  # keys gathered for each query, a row in several queries' sets (NAT's neighbourhoods)
    for record in candidates:
        t = record.tensor
        found = maps[record.index] = rows_of(t, steps)
        # a piece holds each of its rows once: rows repeated are a repeat (keys rotated after the head repeat), no
        # piece of the step (a shared key repeated in every group is read as a product's operand alone)
        if found is None or found[2] or layouts(steps[found[0]].shape, tuple(t.shape)):
            continue
        if found[1].unique().numel() != found[1].numel():
            neighbours = neighbours or (found[0] in keys and t.dim() > len(steps[found[0]].shape))
            continue
        d = steps[found[0]].d
        index = found[1][..., None] * d + torch.arange(d)
        out.setdefault(record.index, {})[steps[found[0]].shape] = (
            index, "each row the step's row at its (batch, head, token)")
    roots = []
    parts: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}  # products no softmax normalizes whole
    words = "each cell the step's cell at its query's and key's (batch, head, token)"
    for record in records:
        func = record.func.split(".")[-1]
        if func == "cat":  # products joined along the keys' axis, then softmaxed (Pegasus-X's block queries
            piece = joined(record, parts)  # against the global keys and against their own block's)
        elif func in VIEWS and len(record.parents) == 1 and record.parents[0] in parts:  # a product viewed back
            shape, index = parts[record.parents[0]]  # from its bmm's [b·h·blocks, q, k] (BigBird's torch_bmm_nd)
            piece = (shape, index.reshape(record.tensor.shape)) if index.numel() == record.tensor.numel() else None
        elif not is_product(record) or maps.get(record.index) is not None \
                or (not out and not neighbours and not unlaid(record, scores)):
            continue
        else:
            piece = scores_piece(record, records, maps, steps, keys)
        if piece is None:
            continue
        shape, index = piece
        # the tensors made from it elementwise (scaled, masked, softmaxed), no reduction over it (a block's max)
        made = [later for later in records[record.index:] if tuple(later.tensor.shape) == tuple(record.tensor.shape)
                and later.tensor.is_floating_point() and later.func.split(".")[-1] not in REDUCTIONS
                and (later is record or record.index in ancestors(later, records)
                     or (later.func == "recomputed" and later.parents == record.parents))]  # one kernel's steps
        if not any(later.func.split(".")[-1] in SOFTMAXES or later.names[:1] == ["(attention)"] for later in made):
            for later in made:  # a piece the code never normalizes whole (online softmax's blocks of keys) holds
                parts[later.index] = piece  # no query's row, unless joined to others (scaled, masked) before one
            continue
        roots.append((record, index))
        for later in made:
            out.setdefault(later.index, {})[shape] = (index, words)
    return out, roots


def best_equal(records: list[Record], reference: torch.Tensor, skip: torch.Tensor | None,
               gathers: Gathers) -> Match | None:
    """The pieces equal to `reference` gathered at their rows or cells, where together they hold every row of it
    (the last axis's rows; rows `skip` leaves out whole need none): the largest of them, a named one first, its
    layout saying how many there are; None where they hold less (a piece of some queries alone is no step)."""
    tol = tolerance(reference)
    shape = tuple(reference.shape)
    found = []
    held = torch.zeros(reference.numel() // shape[-1], dtype=torch.bool)
    for record in records:
        piece = gathers.get(record.index, {}).get(shape)
        if piece is None:
            continue
        index, what = piece
        layout = Gathered(tuple(range(reference.dim())), True, None, index, what)
        user_shape = tuple(record.tensor.shape)
        skipped = layout.apply(skip.expand(shape), user_shape) if skip is not None else None
        diff = difference(record.tensor, layout.apply(reference, user_shape), skipped)
        if diff <= tol:
            found.append(Match(record, layout, diff, tol))
            held[index.reshape(-1) // shape[-1]] = True
    if skip is not None:
        held |= skip.expand(shape).reshape(-1, shape[-1]).all(-1)
    if not found or not bool(held.all()):
        return None
    best = max(found, key=lambda m: (m.record.tensor.numel(), bool(m.record.names), -m.record.index))
    assert isinstance(best.layout, Gathered)
    others = [m.record for m in found if m is not best]
    if others:
        lines = ", ".join(f"{r.label} (line {r.line}) {list(r.tensor.shape)}" for r in others[:2])
        more = f" and {len(others) - 2} more" if len(others) > 2 else ""
        best.layout.what += f"; with {lines}{more}, every query's row"
    best.max_abs_diff = max(m.max_abs_diff for m in found)
    return best


def _queries(index: torch.Tensor, n_k: int) -> torch.Tensor:
    """The query of each row of a piece of the scores (its cells' flat positions in `[.., n_K]`, n_K = `n_k`): its
    flat (batch, head, token), `[.., m]`."""
    return index[..., 0] // n_k


def piece_queries(pieces: list[tuple[Record, torch.Tensor]], shape: tuple[int, ...]) -> list[torch.Tensor] | None:
    """Each piece's queries, flat over the scores' `[n_batch, n_head, n_Q]` (`shape`, the scores'); None where a
    query is in two pieces, or in none."""
    rows = [_queries(index, shape[-1]).reshape(-1) for _, index in pieces]
    every = torch.cat(rows)
    if len(set(every.tolist())) != every.numel() or every.numel() != shape[0] * shape[1] * shape[2]:
        return None
    return rows


