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

What else reads the pieces: the catalog's softmax over the queries within each piece (`softmax_in_pieces`,
softmax.axis); any entry made in some of the pieces alone where none reproduces the output made everywhere
(`in_some_pieces`, diagnose.by_experiment); and groups with no shared token, read as the code's convention without a
--mask (`grouping`, regroup.read)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnscope.usertrace.align import Layout, Match, ancestors, difference, layouts, tolerance
from attnscope.usertrace.record import SOFTMAXES

if TYPE_CHECKING:
    from collections.abc import Iterator

    from attnscope.trace import Trace
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.rerun import Base
    from attnscope.usertrace.trials import Trial

# the reference's steps of the heads, [n_batch, n_head, n, d], whose rows a piece's rows may be
HEAD_STEPS = ("Q_split", "Q_normed", "Q_rot", "K_split", "K_normed", "K_rot", "K_rep", "V_split", "V_rep", "x_raw")
QUERIES, KEYS = ("Q_split", "Q_normed", "Q_rot"), ("K_split", "K_normed", "K_rot", "K_rep")
MATMUL_FUNCS = ("matmul", "__matmul__", "bmm", "einsum")
REDUCTIONS = ("max", "amax", "min", "amin", "sum", "mean", "logsumexp", "norm")
VIEWS = ("view", "reshape", "_unsafe_view", "flatten", "unflatten")  # a product read anew in its own order
MAX_ROWS = 2048  # a step's rows compared with each other once: n_batch · n_head · n at most
MAX_PIECES = 8  # the pieces of the scores a softmax over the queries is tried in, every one of them at once


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


def score_pieces(trace: Trace, records: list[Record]) -> list[tuple[Record, torch.Tensor]]:
    """The code's products of a piece of the queries and one of the keys (its scores in pieces), each with the flat
    positions of its cells in the reference's scores."""
    return _scan(trace, records)[1]


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
    if _piece_queries(pieces, shape) is None:
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


def _scan(trace: Trace, records: list[Record]) -> tuple[Gathers, list[tuple[Record, torch.Tensor]]]:
    shapes = {name: tuple(trace[name].shape) for name in HEAD_STEPS if name in trace and trace[name].dim() == 4
              and trace[name].shape[0] * trace[name].shape[1] * trace[name].shape[2] <= MAX_ROWS}
    if not any(n in shapes for n in QUERIES) or not any(n in shapes for n in KEYS):
        return {}, []
    # the tensors that may be pieces: of a step's width, in no layout of it (the common run has none: nothing more)
    candidates = [r for r in records if r.tensor.is_floating_point() and r.tensor.dim() >= 2 and any(
        r.tensor.shape[-1] == shape[-1] and not layouts(shape, tuple(r.tensor.shape)) for shape in shapes.values())]
    scores = tuple(trace["scores"].shape) if "scores" in trace else None
    if not candidates and not any(_unlaid(record, scores) for record in records):
        return {}, []
    steps = {name: step for name in shapes if (step := _Step(trace[name])).distinct}
    maps: dict[int, tuple[str, torch.Tensor, bool] | None] = {}  # record -> (step, flat row over [b, h, n], turned)
    out: Gathers = {}
    for record in candidates:
        t = record.tensor
        found = maps[record.index] = _rows(t, steps)
        # a piece holds each of its rows once: rows repeated are a repeat (keys rotated after the head repeat), no
        # piece of the step (a shared key repeated in every group is read as a product's operand alone)
        if found is None or found[2] or layouts(steps[found[0]].shape, tuple(t.shape)) \
                or found[1].unique().numel() != found[1].numel():
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
            piece = _joined(record, parts)  # against the global keys and against their own block's)
        elif func in VIEWS and len(record.parents) == 1 and record.parents[0] in parts:  # a product viewed back
            shape, index = parts[record.parents[0]]  # from its bmm's [b·h·blocks, q, k] (BigBird's torch_bmm_nd)
            piece = (shape, index.reshape(record.tensor.shape)) if index.numel() == record.tensor.numel() else None
        elif not _product(record) or maps.get(record.index) is not None or (not out and not _unlaid(record, scores)):
            continue
        else:
            piece = _scores_piece(record, records, maps, steps)
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


def _joined(record: Record, parts: dict[int, tuple[tuple[int, ...], torch.Tensor]]
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


def _product(record: Record) -> bool:
    """Whether `record` is a product of two operands, or the scores a kernel computes without materializing them
    (F.scaled_dot_product_attention's, recomputed: kernels.py)."""
    return record.func.split(".")[-1] in MATMUL_FUNCS \
        or (record.func == "recomputed" and record.names[:1] == ["(scores)"])


def operands_of(record: Record) -> list[int]:
    """The records a product reads, in order: a recomputed kernel's scores read the kernel's query and key (its
    first two parents)."""
    from attnscope.usertrace.flow import records_read

    return list(record.parents[:2]) if record.func == "recomputed" else records_read(record)


def _unlaid(record: Record, scores: tuple[int, ...] | None) -> bool:
    """Whether `record` is a product smaller than the scores `scores` and in no layout of them: a piece of the scores
    whose operands may be layouts of the steps, not pieces, where its batch axes pair each group's queries with its
    own keys (Hiera's mask units beside pooled queries, `[B, heads, units, q, d] @ [B, heads, units, d, k]`)."""
    return scores is not None and _product(record) and record.tensor.dim() >= 3 \
        and record.tensor.numel() < math.prod(scores) and not layouts(scores, tuple(record.tensor.shape))


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


class _Step:
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


def _rows(tensor: torch.Tensor, steps: dict[str, _Step]) -> tuple[str, torch.Tensor, bool] | None:
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


def _matched(user: torch.Tensor, step: _Step) -> torch.Tensor | None:
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


def _scores_piece(record: Record, records: list[Record], maps: dict[int, tuple[str, torch.Tensor, bool] | None],
                  steps: dict[str, _Step]) -> tuple[tuple[int, ...], torch.Tensor] | None:
    """(the scores' shape, each cell's flat position in it) where `record` multiplies a piece of the queries by one
    of the keys and every sequence pairs one batch element's and head's; None otherwise."""
    given = operands_of(record)
    if len(given) != 2:
        return None
    for g in given:
        if g not in maps:
            maps[g] = _rows(records[g].tensor, steps)
    left, right = maps[given[0]], maps[given[1]]
    if left is None or right is None:
        return None
    (q_name, q_rows, q_turned), (k_name, k_rows, _) = left, right
    if q_name not in QUERIES or k_name not in KEYS or q_turned:
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


def softmax_in_pieces(b: Base) -> Iterator[Trial]:
    """softmax.axis where the code computes its scores in pieces (each group's queries against its keys): the
    softmax over the queries of each piece (`dim=-2` of `[.., m, k]`), in every piece or in some (a shared token's
    own call may keep the keys' axis), the rest of the run the reference's."""
    from itertools import combinations

    from attnscope.usertrace.rerun import replay
    from attnscope.usertrace.trials import Trial

    if b.col or "attention" not in b.ref or b.ref["attention"].dim() != 4:
        return
    pieces = score_pieces(b.ctx.reference, b.ctx.records)
    shape = tuple(b.ref["attention"].shape)
    if not pieces or len(pieces) > MAX_PIECES or "scores" not in b.ref or tuple(b.ref["scores"].shape) != shape:
        return
    if _piece_queries(pieces, shape) is None:
        return  # a query in two pieces, or in none
    steps = replay(b)
    logits = steps.get("masked_scores", steps["scores"]).reshape(-1)
    # every piece, then (where they are few) some of them: BigBird's five kinds of block each softmaxed apart
    counts = range(len(pieces), 0, -1) if len(pieces) <= 4 else (len(pieces),)
    for count in counts:
        for chosen in combinations(range(len(pieces)), count):
            attention = torch.zeros(shape, dtype=logits.dtype).reshape(-1)
            for i, (_, index) in enumerate(pieces):
                axis = -2 if i in chosen else -1
                attention[index.reshape(-1)] = torch.softmax(logits[index], dim=axis).reshape(-1)
            attention = attention.reshape(shape)
            yield Trial(replay(b, after_softmax=attention - steps["attention"]),
                        f"the softmax ran over the queries, not over the keys: {{who}} equals the reference's "
                        f"attention with the softmax of your scores' pieces ({_said(pieces, chosen)}: each group's "
                        "queries against its keys, [.., n_Q, n_K] a group) over their queries' axis (dim=-2), so each "
                        "group's weights sum to 1 over its queries rather than over its keys")


def in_some_pieces(b: Base, trial: Trial, pieces: list[tuple[Record, torch.Tensor]]) -> Iterator[Trial]:
    """`trial` made in some of the code's pieces of the scores alone (a scale left out of the groups' call, not the
    shared token's): its attention in the rows of the queries those pieces hold, the reference's elsewhere, the run
    from there on the reference's. Only a trial that changes the attention and leaves the values as they are;
    `pieces`: score_pieces'."""
    from itertools import combinations

    from attnscope.usertrace.rerun import replay
    from attnscope.usertrace.trials import Trial

    changed = trial.steps.get("attention")
    if b.col or changed is None or "attention" not in b.ref or tuple(changed.shape) != tuple(b.ref["attention"].shape) \
            or any(name in trial.steps for name in (b.names.get("v", "V_split"), "V_rep", "V_cat")):
        return
    shape = tuple(changed.shape)
    if len(pieces) < 2 or len(pieces) > 4:
        return
    rows = _piece_queries(pieces, shape)
    if rows is None:
        return
    reference = replay(b)
    plain = reference["attention"]
    if float((changed - plain).abs().max()) == 0.0:
        return
    for count in range(1, len(pieces)):
        for chosen in combinations(range(len(pieces)), count):
            held = torch.zeros(shape[0] * shape[1] * shape[2], dtype=torch.bool)
            for i in chosen:
                held[rows[i]] = True
            steps = replay(b, after_softmax=torch.where(held.reshape(*shape[:3], 1), changed, plain) - plain)
            for name in ("scores", "capped_scores", "biased_scores", "masked_scores"):  # the scores mixed alike
                if name in trial.steps and name in steps and trial.steps[name].shape == steps[name].shape:
                    steps[name] = torch.where(held.reshape(*shape[:3], 1), trial.steps[name], reference[name])
            yield Trial(steps, trial.words + f", in your scores' pieces {_said(pieces, chosen)} "
                        "alone (the other pieces' queries as the reference computes them)", trial.ratio,
                        trial.fits, trial.tol, trial.detail)


def _queries(index: torch.Tensor, n_k: int) -> torch.Tensor:
    """The query of each row of a piece of the scores (its cells' flat positions in `[.., n_K]`, n_K = `n_k`): its
    flat (batch, head, token), `[.., m]`."""
    return index[..., 0] // n_k


def _piece_queries(pieces: list[tuple[Record, torch.Tensor]], shape: tuple[int, ...]) -> list[torch.Tensor] | None:
    """Each piece's queries, flat over the scores' `[n_batch, n_head, n_Q]` (`shape`, the scores'); None where a
    query is in two pieces, or in none."""
    rows = [_queries(index, shape[-1]).reshape(-1) for _, index in pieces]
    every = torch.cat(rows)
    if len(set(every.tolist())) != every.numel() or every.numel() != shape[0] * shape[1] * shape[2]:
        return None
    return rows


def _said(pieces: list[tuple[Record, torch.Tensor]], chosen: tuple[int, ...]) -> str:
    """The `chosen` pieces of the scores in words: each one's name, shape and line."""
    return ", ".join(f"{pieces[i][0].label} {list(pieces[i][0].tensor.shape)} (line {pieces[i][0].line})"
                     for i in chosen)
