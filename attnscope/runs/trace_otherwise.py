"""Parameters read otherwise: where correct code raised on what trace first gave a parameter, and on every layout
runs/trace_layouts.py tries, the other things such a parameter can be, read from how the code used it
(usertrace/paramuse.py), each run in turn (in the row layout, then time-first), the first the code runs on kept with
a note, before trace ever says "your code raised":

- the one input taken apart as a list (`inputs[0]`, `inputs[1]`, `inputs[2]`; `q, k, v = qkv`): handed a list of
  it, query, key and value the same tensor (Music Transformer's `self.rga([x, x, x], mask)`);
- a second tensor the code computes with as integers (`positions % W`, `table[pos]`): the tokens' positions,
  arange(n_Q) (mistral-src's `positions`), else one row of them for each sequence, [n_batch, n_Q] (Griffin's
  `segment_pos`, asserted [b, t] before any use); a required position embedding trace made up too, where its
  shapes all raised, and positions named so, given [n_Q], as rows;
- a second tensor on the path of the op it raised in: a relative position embedding (Transformer-XL's
  `r` [klen, 1, d] time-first, XLNet's [qlen + klen, n_batch, d], ESPnet's [1, 2n-1, d]);
- a memory read as four axes (`b, t, m = media.shape[:3]`): `[n_batch, n_t, n_m, d]`, its n_t·n_m keys the
  reference's (Flamingo's media: n_t images of n_m latents each).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from attnscope.errors import AttnscopeError, UsageError
from attnscope.runs.trace_attempt import attempted
from attnscope.usertrace import tableforms as tables

if TYPE_CHECKING:
    from attnscope.runs.trace_attempt import Made, RunSoFar
    from attnscope.usertrace.load import Plan
    from attnscope.usertrace.record import Failure

Retry = Callable[["RunSoFar", "Made"], "Made"]


def otherwise(r: RunSoFar, ran: Made, then: tuple[Retry, ...] = ()) -> Made:
    """`ran`, where it ran; else the first other reading of a parameter the op it raised in reads (or its line
    names) that the code runs on, each tried as it is and then through `then` (time-first inputs), with its note."""
    from attnscope.usertrace import paramuse

    called = ran[2]
    failed = called.failure
    if failed is None or r.o.q or r.o.cache or r.o.layout != "row":
        return ran
    invented = [n for n in r.plan.embeddings_required if n in r.plan.embeddings]  # shapes trace made up
    names = [*r.plan.tensors, *invented, *r.plan.position_tensors]
    for name in paramuse.culprits(called.records, failed, names, r.target.source):
        for plan, words in _readings(r, ran, name):
            kept = r.plan, r.o
            r.plan = plan
            made = attempted(r.attempt, r.o)
            notes = len(r.notes)
            for retry in then if made is None or made[2].failure is not None else ():
                made = retry(r, made if made is not None else ran)
                if made[2].failure is None:
                    break
            if made is not None and made[2].failure is None and (
                    name in r.plan.listed or name in r.plan.grouped or name in r.plan.read_tables
                    or paramuse.apart_from_keys(made[2].records, name)
                    or (_as_positions(r.plan, name) and paramuse.keys_from(made[2].records, r.plan.tensors[0])
                        and not paramuse.turns(made[2].records, None, name, r.plan.tensors[0]))):
                if name in r.plan.embeddings:  # the form it ran on
                    from attnscope.usertrace.feeds import embedding_forms

                    dims = embedding_forms(r.o.layout).get(r.plan.embedding_form)
                    words = f"a random {r.plan.embedding_form} position embedding [{', '.join(dims)}]" if dims \
                        else "a random position embedding shaped as the input"
                r.notes.insert(notes, _note(name, words, failed))
                return made
            r.plan, r.o = kept
            del r.notes[notes:]
        if _table(r, ran, name):  # RoPE's table by its use, in no form trace knows: never positions by accident
            if r.spec.rope_base is None:
                raise UsageError(tables.unasked(name, failed))
            raise AttnscopeError(tables.unread(name, failed))
    return ran


def _readings(r: RunSoFar, ran: Made, name: str) -> Iterator[tuple[Plan, str]]:
    """The other readings of the parameter `name`, in the order its use says: (the plan, what it is then given)."""
    from attnscope.usertrace import paramuse

    called, plan = ran[2], r.plan
    records, failed = called.records, called.failure
    assert failed is not None
    positions = [(plan.as_positions(name), "the tokens' positions, torch.arange(n_Q)"),
                 (plan.as_positions(name, rows=True), "the tokens' positions, one row for each sequence, "
                                                      "torch.arange(n_Q).repeat(n_batch, 1) [n_batch, n_Q]")]
    if _table(r, ran, name):  # multiplied into the features as it is: RoPE's table, in the form the code runs on
        if r.spec.rope_base is not None:
            yield plan.as_table(name), "RoPE's table"
        return
    if name in plan.embeddings:  # made up by trace in each of its shapes, all raised on
        yield from positions
        return
    if name in plan.position_tensors:  # named so, and raised on as [n_Q]
        yield positions[1]
        return
    if plan.self_attention:
        count = paramuse.listed(records, failed, name, _source(r.fn))
        if count is not None:
            yield plan.as_list(name, count), f"a list of {count}, each the input itself (self-attention)"
        return
    if name == plan.tensors[0]:
        return
    if paramuse.four_axes(failed, name, r.target.source):
        yield plan.as_grouped(name), "[n_batch, 1, n_K, d_feat], its n_K tokens one group (the same keys)"
        return
    embedding = [(plan.as_embedding(name), "a random position embedding")]
    yield from positions + embedding if paramuse.integers(records, failed, name) else embedding + positions


def _table(r: RunSoFar, ran: Made, name: str) -> bool:
    """Whether the code multiplies the parameter `name`'s values as given into its queries or keys (paramuse.turns):
    RoPE's table, never positions nor an embedding; never the keys or values of `forward(query, key, value)`, whose
    keys meet the queries as they are in the scores."""
    from attnscope.usertrace import paramuse

    called, given = ran[2], r.plan.tensors
    return bool(given) and name != given[0] and not (len(given) == 3 and name in given) and paramuse.turns(
        called.records, called.failure, name, r.plan.tensors[0])


def _as_positions(plan: Plan, name: str) -> bool:
    """Whether the parameter `name` is given the tokens' positions in `plan` (their turns of the keys, RoPE's, read
    from them as the code reads them)."""
    return name in plan.position_tensors or name in plan.position_rows


def _source(fn: Any) -> str:
    """The source of the forward (a module's, or the function), where Python has it ("" where not)."""
    import inspect

    try:
        return inspect.getsource(getattr(fn, "forward", fn))
    except (OSError, TypeError):
        return ""


def _note(name: str, words: str, failed: Failure) -> str:
    """The note for a parameter read otherwise."""
    where = f"line {failed.line}: " if failed.line else ""
    return (f"{name}: your code raised on the input trace first gave it ({where}{failed.message}) and runs on "
            f"{words}, which it was given, as its use reads (usertrace/paramuse.py); a convention, not a mistake")


def alias_note(name: str, first: str, failed: Failure | None) -> str:
    """The note for a memory parameter handed the input itself."""
    where = f" (line {failed.line}: {failed.message})" if failed is not None and failed.line else ""
    return (f"{name}: your code raised with {name} = None{where} and with a memory of other keys, and runs with "
            f"{name} = {first}, the same tensor: self-attention, as its callers hand it (--nk gives it a memory "
            "of other keys)")

