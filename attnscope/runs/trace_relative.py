"""A position embedding trace invents for the code (ESPnet's `pos_emb`): where the code raised on each shape trace
gave it (the input's own, then a relative embedding's, feeds.RELATIVE), the run again with keys as many as the
queries, as a relative embedding over positions n-1 .. -(n-1) needs; where it still raises in an op that reads the
embedding, one line saying which input to give, never "your code raised" on an input trace made up. So with RoPE's
tables left at their default None without --rope (Zamba2's position_embeddings=None): where the code raises on them,
one line asking for --rope."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from attnscope.runs.trace_attempt import Made, RunSoFar
    from attnscope.usertrace.call import Called


def equal_lengths(r: RunSoFar, ran: Made) -> Made:
    """`ran`, or where it raised with query, key and value of other lengths and a position embedding trace made, the
    run with n_K = n_Q, with the note that says so."""
    inputs, _, called, _ = ran
    invented = [n for n in r.plan.embeddings_required if n in r.plan.embeddings]
    if called.failure is None or not invented:
        return ran
    n_Q, n_K = inputs.sizes.get("n_Q"), inputs.sizes.get("n_K")
    if not r.plan.self_attention and r.o.nk is None and r.o.nq is None and n_Q is not None and n_K != n_Q:
        again = r.attempt(dataclasses.replace(r.o, nq=n_Q, nk=n_Q))
        if again[2].failure is None:
            failed = called.failure
            where = f"line {failed.line}: " if failed.line else ""
            r.notes.append(f"your code failed with keys of another length than the queries ({where}{failed.message}) "
                           f"and ran with n_K = n_Q = {n_Q}, as a relative position embedding ({', '.join(invented)}) "
                           "needs; --nq and --nk say the lengths")
            return again
    return ran


def refused(r: RunSoFar, ran: Made) -> Made:
    """`ran`; a UsageError where it raised in an op that reads a position embedding trace made up."""
    called = ran[2]
    invented = [n for n in r.plan.embeddings_required if n in r.plan.embeddings]
    if called.failure is None or not invented or not _reads(called, invented):
        return ran
    failed = called.failure
    where = f" at line {failed.line}" if failed.line else ""
    raise UsageError(f"{', '.join(invented)}: your code raised{where} ({failed.message}) on each position embedding "
                     "trace made for it (the input's shape [n_batch, n, d], a relative one's [1, 2n-1, d] and "
                     "[n_batch, 2n-1, d], one for the batch [1, n, d]); trace the module that makes it and calls "
                     "yours (ESPnet's encoder layer beside its pos_enc), or give it a default")


def tables_asked(r: RunSoFar, ran: Made) -> Made:
    """`ran`; a UsageError asking for --rope where the code raised with RoPE's tables None (their default, no --rope
    given): the op or line it raised in reads them, or it met a None."""
    from attnscope.usertrace import paramuse

    failed, unasked = ran[2].failure, r.plan.tables_unasked
    if failed is None or not unasked or not (paramuse.culprits(ran[2].records, failed, unasked, r.target.source)
                                             or "NoneType" in failed.message):
        return ran
    where = f"line {failed.line}: " if failed.line else ""
    raise UsageError(f"{r.plan.signature} takes RoPE's tables ({', '.join(unasked)}) and raised without them "
                     f"({where}{failed.message}): add --rope (and --rope-base B) so that trace can make them and the "
                     "reference rotates alike")


def _reads(called: Called, names: list[str]) -> bool:
    """Whether the op the code raised in reads one of the inputs `names`, or a tensor made from one."""
    from attnscope.usertrace.align import ancestors

    failure, records = called.failure, called.records
    assert failure is not None
    given = [v for kind, v in failure.args if kind == "rec" and isinstance(v, int) and v < len(records)]
    texts = {v for kind, v in failure.args if kind == "text"}
    up = set().union(*(ancestors(records[i], records) | {i} for i in given)) if given else set()
    read = {v for i in up for kind, v in records[i].args if kind == "text"}
    return bool((texts | read) & set(names))
