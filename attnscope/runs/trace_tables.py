"""RoPE's pair of tables in another order or layout, read once the code has run on trace's first ones and the
reference's whole spec is known (its qk-norm, its share of each head): where the line-up diverges, the code is run
again on the pair in each other form tablelayouts.py knows (sin first, interleaved), and the form under which it
lines up further is kept, with a note. A module's rotary tables are made outside the traced code, so their form is
a convention to read, never a mistake."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from attnscope.runs.trace_attempt import RunSoFar, form_spec, table_width

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnscope.runs.trace_attempt import Made
    from attnscope.runs.trace_result import TraceRun
    from attnscope.usertrace.lined import LineUp


def other_layouts(r: RunSoFar, run: TraceRun, ran: Made, lined: LineUp,
                  again: Callable[[RunSoFar, TraceRun], Made]) -> tuple[Made, LineUp]:
    """The run and its line-up on the pair's form under which the code lines up furthest (ties keep trace's first)."""
    from attnscope.usertrace import tablelayouts
    from attnscope.usertrace.feeds import TableForm
    from attnscope.usertrace.lineup import line_up
    from attnscope.usertrace.ranking import better_fit, sees

    d_head = ran[0].sizes.get("d_head")
    if lined.divergence is None or not r.plan.tables or r.spec.rope_base is None or r.weighted is None or not d_head \
            or any(f.holds not in tablelayouts.PAIRED or f.axes is not None for f in r.table_form):
        return ran, lined
    given = r.table_form[0] if r.table_form else TableForm(table_width(r.spec, r.plan, d_head) or d_head)
    base = TableForm(given.width, given.pairs, holds=given.holds)
    forms = [f for f in tablelayouts.variants([base], r.plan, r.o.rope_pairing) if f != given]
    if not forms:
        return ran, lined
    kept: tuple[Any, ...] = (r.spec, list(r.table_form), list(r.sliced), _words(run), ran, lined)
    first_spec = dataclasses.replace(r.spec)
    for form in forms:
        r.table_form[:] = [form]
        r.spec = form_spec(first_spec, form, d_head)
        made = again(r, run)
        if made[2].failure is not None:
            continue
        tried = line_up(r.weighted, r.shapes, made[0], made[2].records, r.o.train, r.spec)
        # a form that only loses sight of the step whose mistake the kept one named by experiment (the keys' norm
        # left out, K_normed unseen once the tables are interleaved) lines up no further
        if better_fit(tried, kept[5]) and sees(tried, kept[5]) and kept[5].divergence is not None:
            note = tablelayouts.note(form, r.plan.tables, given.width, d_head, None)
            kept = (r.spec, [form], [note], _words(run), made, tried)
            if tried.divergence is None:  # the likeliest form under which it lines up whole
                break
    r.spec, r.table_form[:], r.sliced[:] = kept[0], kept[1], kept[2]
    run.__dict__.update(_words(kept[3]))
    return kept[4], kept[5]


def _words(run: Any) -> dict[str, Any]:
    """What a run again rewrites of `run` (its notes, header, parameters, failure), copied."""
    words = run if isinstance(run, dict) else run.__dict__
    return {k: list(v) if isinstance(v, list) else v for k, v in words.items()}
