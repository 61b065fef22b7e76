"""--position-bias as a relative key table: Shaw et al.'s relative keys handed to the attention as an argument.

SpeechT5 (transformers' `SpeechT5Attention`) takes `position_bias` `[n_Q, n_K, d_head]` from its encoder's
`SpeechT5RelativePositionalEncoding` (an embedding of the clipped distances i − j) and adds `q_i · P[i, j]` to score
(i, j): `torch.matmul(reshape_q, position_bias.transpose(-2, -1))`, its queries already scaled. Shaw et al. 2018 add
`q_i · a_ij^K` to `q_i · k_j` before the scale, and so do Nezha's and Music Transformer's relative keys: both are
`(q_i · k_j + q_i · P[i, j]) · scale`. A file of that shape is the code's argument as it holds it; the reference
computes the same term from its own queries (never from the code's: a table transposed where the code reads it is
then the code's mistake, t5.transposed by experiment) and adds it, scaled, as its position bias. A tensor that
broadcasts to the scores stays an additive bias (T5's); one of neither shape is refused in one line.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnscope.trace import Trace
    from attnscope.usertrace.refspec import Spec

# the queries the reference's scores read, latest first (as rerun.Q_NAMES): a module's in heads [.., n_head, n, d_head],
# a function's Q as it is given ([.., n_Q, d_K])
QUERIES = ("Q_tuned", "Q_rot", "Q_normed", "Q_split", "Q")


def _broadcasts(shape: tuple[int, ...], scores: tuple[int, ...]) -> bool:
    from attnscope.cost import broadcast_shapes

    try:
        return len(shape) >= 2 and broadcast_shapes(shape, scores) == scores
    except ValueError:
        return False


def table_of(bias: torch.Tensor | None, scores: tuple[int, ...], d_head: int) -> torch.Tensor | None:
    """`bias` where it is a relative key table `[n_Q, n_K, d_head]` for scores `[.., n_Q, n_K]`; None where it is
    no bias or an additive one (it broadcasts to the scores). Any other shape is refused, both shapes said."""
    if bias is None or _broadcasts(tuple(bias.shape), scores):
        return None
    n_Q, n_K = scores[-2:]
    if tuple(bias.shape) == (n_Q, n_K, d_head):
        return bias
    raise UsageError(f"{{position_bias}} is {list(bias.shape)} but the scores are {list(scores)} and d_head is "
                     f"{d_head}: give an additive bias that broadcasts to the scores ([.., n_Q, n_K] = [.., {n_Q}, "
                     f"{n_K}], T5's) or a relative key table ([n_Q, n_K, d_head] = [{n_Q}, {n_K}, {d_head}], "
                     "SpeechT5's and Shaw et al.'s, q_i · P[i, j] added to score (i, j))", "position_bias")


def term(queries: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """q_i · P[i, j] for every query i and key j, in float64: `[.., n_Q, d_head]`, `[n_Q, n_K, d_head]` ->
    `[.., n_Q, n_K]`."""
    return torch.einsum("...id,ijd->...ij", queries.double(), table.double())


def queries_of(trace: Trace) -> torch.Tensor | None:
    """The queries the reference's scores read, `[.., n_Q, d_head]` (a module's in heads)."""
    names = [step.name for step in trace.steps]
    for name in QUERIES:
        if name in names and trace[name].dim() >= (2 if name == "Q" else 3):
            return trace[name]
    return None


def run_keyed(run: Callable[[Any], Trace], spec: Spec, d_head: int) -> Trace:
    """The reference's trace from `run(position_bias)`: as it is where --position-bias is none or additive; with a
    relative key table, run once without it for the reference's own queries, then again adding the table's term
    `q_i · P[i, j]` times the scale (Shaw's and SpeechT5's: scaled with q · kᵀ) to its scores."""
    try:  # no bias, or an additive one: it broadcasts to the scores
        return run(spec.added(d_head))
    except UsageError as exc:
        if spec.position_bias is None or "position_bias" not in exc.params:
            raise
    rest = replace(spec, position_bias=None).added(d_head)
    first = run(rest)
    if "scores" not in first:
        return run(spec.added(d_head))  # its own refusal
    queries = queries_of(first)
    table = table_of(spec.position_bias, tuple(first["scores"].shape),
                     int(queries.shape[-1]) if queries is not None else d_head)
    if table is None:
        return run(spec.added(d_head))
    if queries is None:
        raise UsageError("{position_bias} is a relative key table [n_Q, n_K, d_head], and the reference holds no "
                         "queries to read it with", "position_bias")
    scale = spec.scale if spec.scale is not None else d_head ** -0.5
    added = (term(queries, table) * scale).to(first["scores"].dtype)
    return run(added if rest is None else rest + added)


def note(spec: Spec | None, trace: Trace | None) -> str | None:
    """The note for a key table the reference read its term from; None where there is none."""
    if spec is None or trace is None or spec.position_bias is None or spec.position_bias.dim() != 3 \
            or "scores" not in trace:
        return None
    queries = queries_of(trace)
    if queries is None:
        return None
    try:
        table = table_of(spec.position_bias, tuple(trace["scores"].shape), int(queries.shape[-1]))
    except UsageError:
        return None
    if table is None:
        return None
    return (f"--position-bias {list(table.shape)} read as a relative key table [n_Q, n_K, d_head] (Shaw et al.'s, "
            "SpeechT5's position_bias): the reference adds q_i · P[i, j], from its own queries, to score (i, j) "
            "with q_i · k_j, before the scale")


def keyed_bias(bias: torch.Tensor | None, table: torch.Tensor, base_q: torch.Tensor, q: torch.Tensor,
               scale: float) -> torch.Tensor:
    """A replay's bias where its queries are `q` (an experiment changed them): the table's term from them in place of
    the reference's (`base_q`'s), the rest of `bias` as it is."""
    new = term(q, table) * scale
    return new if bias is None else bias - term(base_q, table) * scale + new
