"""The catalog's experiments in the code's pieces of the scores (gathered.py reads them): the softmax over the
queries within each piece (softmax.axis), and any entry made in some of the pieces alone where none reproduces the
output made everywhere (diagnose.by_experiment)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnscope.usertrace.gathered import piece_queries, score_pieces

if TYPE_CHECKING:
    from collections.abc import Iterator

    from attnscope.usertrace.record import Record
    from attnscope.usertrace.rerun import Base
    from attnscope.usertrace.trials import Trial

MAX_PIECES = 8  # the pieces of the scores a softmax over the queries is tried in, every one of them at once


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
    if piece_queries(pieces, shape) is None:
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
    rows = piece_queries(pieces, shape)
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


def _said(pieces: list[tuple[Record, torch.Tensor]], chosen: tuple[int, ...]) -> str:
    """The `chosen` pieces of the scores in words: each one's name, shape and line."""
    return ", ".join(f"{pieces[i][0].label} {list(pieces[i][0].tensor.shape)} (line {pieces[i][0].line})"
                     for i in chosen)
