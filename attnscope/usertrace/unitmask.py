"""Units whose queries are not their keys, read as the mask they make: Hiera's mask unit attention at a stage
transition, whose queries are max-pooled inside each unit (pooled.py reads the pooling) while its keys and values
are not (`qkv.reshape(B, tokens_per_unit, units, 3, heads, d).permute(3, 0, 4, 2, 1, 5)`, the queries
`.view(B, heads, units, stride, -1, d).max(dim=3)`): each unit's few queries meet its own keys alone, token t in unit
t % units. No regrouping of the input holds that (regroup.py needs each group's queries to be its keys), so it is
read from the scores: the code's products of the queries and the keys are pieces of the reference's scores
(gathered.py: each cell the reference's cell of its query and key), every query in one piece, each piece softmaxed
whole. The keys each query meets are then a mask, the same in every head; the reference is run under it (the
reference's mask alone: the code is given nothing) and kept where that lines up better. A convention, with a note;
a mistake inside is named by experiment under the same mask.

A pairing is a convention only where each query meets the tokens it is made from: a unit's pooled queries its own
unit's keys. Which tokens those are is read by experiment (_made_from): the code run again with one token of each
sequence moved at a time, the tokens whose move changes a query's row are its own. Each unit's queries against the
next unit's keys (a roll of the keys along the units) are then no convention, and the divergence stands."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from attnscope.words import run_of

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.lined import LineUp
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Spec


MAX_PROBES = 64  # runs again at most, one token of each sequence moved in each


def read(module: Any, shapes: Any, inputs: Inputs, records: list[Record], train: bool, spec: Spec,
         lined: LineUp, probe: Callable[[Inputs], list[Record] | None]) -> tuple[Inputs, LineUp, str] | None:
    """(the inputs with the units' mask as the reference's, the line-up under it, a note), where the code's scores are
    pieces that pair each query with some keys alone, each query among them the tokens it is made from, and the
    line-up under that mask fits better than `lined`; (`inputs`, `lined` as they are, a note saying why not) where a
    query's keys leave out a token it is made from; None otherwise (a --mask file or a mask parameter given: the
    units are read on their own). `probe`: the code run again on other inputs, its records (None where it fails)."""
    from attnscope.usertrace.gathered import pattern, score_pieces
    from attnscope.usertrace.ranking import better_fit
    from attnscope.usertrace.relined import line_up_again

    if lined.divergence is None or lined.trace is None or inputs.mask is not None or inputs.allowed is not None \
            or len(inputs.tensors) != 1 or inputs.layout != "row" or inputs.cache is not None:
        return None
    found = pattern(lined.trace, records)
    if found is None:
        return None
    mask, piece = found
    made = _made_from(score_pieces(lined.trace, records), records, inputs, probe, tuple(lined.trace["scores"].shape))
    pieces = f"its scores are made in pieces ({piece.label} (line {piece.line}) {list(piece.tensor.shape)})"
    if made is None:
        return None
    left_out = (made & ~mask).nonzero()
    if len(left_out):  # a query meets keys that leave out a token it is made from: no unit of its own
        b, i, t = (int(v) for v in left_out[0])
        return inputs, lined, (f"your code attends to some keys alone from each query ({pieces}, {_words(mask)}), "
                               f"yet these are no units of its own: query {i} of sequence {b} is made from token {t} "
                               "(moving that token alone changes it), which the keys it meets leave out; a unit's "
                               "queries meet that unit's own keys")
    masked = dataclasses.replace(inputs, mask=mask[:, None])
    again = line_up_again(module, shapes, masked, records, train, spec)
    if again is None or not better_fit(again, lined):
        return None
    return masked, again, (f"your code attends within units of its own: {pieces}, {_words(mask)}, each query among "
                           "the tokens it is made from; the reference is run under the mask that says so ([n_batch, "
                           "n_Q, n_K], True where your code pairs a query with a key: a --mask file of it says the "
                           "same)")


def _made_from(pieces: list[tuple[Record, torch.Tensor]], records: list[Record], inputs: Inputs,
               probe: Callable[[Inputs], list[Record] | None], shape: tuple[int, ...]) -> torch.Tensor | None:
    """Which input tokens each query is made from, `[n_batch, n_Q, n_K]` (the scores' queries, `shape` the scores',
    and the input's tokens, every head's together), by experiment: the code run again with one token of each
    sequence moved at a time, a query's row in its pieces' left operand changed where the token is one of its own;
    None where that cannot be read (the run differs in its ops, an operand broadcast, too many runs)."""
    from attnscope.usertrace.align import tolerance
    from attnscope.usertrace.scorepieces import operands_of

    n_batch, n_head, n_q, n_k = shape
    name, x = next(iter(inputs.tensors.items()))
    if x.dim() != 3 or tuple(x.shape[:2]) != (n_batch, n_k) or -(-n_k // n_batch) > MAX_PROBES:
        return None
    operands = []  # (the record of a piece's queries, each of its rows' flat (batch, head, query))
    for record, index in pieces:
        given = operands_of(record)
        left = records[given[0]].tensor if given else None
        if left is None or tuple(left.shape[:-1]) != tuple(index.shape[:-1]):
            return None
        operands.append((given[0], (index[..., 0] // n_k).reshape(-1)))
    made = torch.zeros(n_batch, n_q, n_k, dtype=torch.bool)
    generator = torch.Generator().manual_seed(0)
    for start in range(0, n_k, n_batch):
        tokens = [min(start + b, n_k - 1) for b in range(n_batch)]  # sequence b moves its token start + b
        moved = x.clone()
        for b, t in enumerate(tokens):
            moved[b, t] += 3 * torch.randn(x.shape[-1], generator=generator, dtype=torch.float64).to(x)
        again = probe(dataclasses.replace(inputs, tensors={name: moved}))
        if again is None or len(again) != len(records):
            return None
        for at, rows in operands:
            before, after = records[at].tensor, again[at].tensor
            if after.shape != before.shape:
                return None
            changed = ((after - before).abs() > 10 * tolerance(before)).reshape(-1, before.shape[-1]).any(-1)
            for flat in rows[changed].tolist():  # flat over [n_batch, n_head, n_Q]
                b = flat // (n_head * n_q)
                made[b, flat % n_q, tokens[b]] = True
    return made


def _words(mask: torch.Tensor) -> str:
    """The units in words: how many keys each query meets, and which keys the first query's unit holds."""
    first = mask[0]  # [n_Q, n_K]
    keys = first[0].nonzero().flatten().tolist()
    sharing = int((first == first[0]).all(-1).sum())
    held = run_of("keys", keys)
    counts = sorted({int(n) for n in first.sum(-1).tolist()})
    each = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
    more = f" and {sharing - 1} more" if sharing > 1 else ""
    return f"each query against {each} of the {mask.shape[-1]} keys (query 0{more} against {held})"
