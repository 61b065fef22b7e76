"""Masks given again under the convention read last (issue #41). Where the code raised with trace's mask (or a --mask
file) and ran with its mask parameters at their default (trace_layouts._masks_at_default), a reading kept after that
(one tensor for all three inputs, time-first inputs read by the line-up, the column form) may be what made it raise:
fairseq's MultiheadAttention fed batch-first reads the batch as its tokens, so its `[n_Q, n_K]` attn_mask cannot be
added to its scores. The plan with its masks is run again under the options read since, and kept where it runs (and,
once the run is lined up, lines up no worse): the mask reaches the argument the code reads it from, in the code's
convention, and the reference's mask is compared with the code's use of it rather than with the code unmasked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnscope.runs.trace_attempt import attempted

if TYPE_CHECKING:
    from attnscope.runs.trace_attempt import Made, RunSoFar
    from attnscope.runs.trace_options import TraceOptions
    from attnscope.runs.trace_result import TraceRun
    from attnscope.usertrace.lined import LineUp


LAYOUTS = {"row": "inputs [n_batch, n, d]", "time": "time-first inputs [n, n_batch, d]", "col": "the column form",
           "bthd": "inputs [n_batch, n, n_head, d]", "tbhd": "time-first inputs [n, n_batch, n_head, d]"}


def masked_again(r: RunSoFar, ran: Made) -> Made:
    """`ran`, or where the options changed since the masks were left at their default, the code run with them under
    the options read since, kept (with its note in place of the one that left them) where it runs."""
    made = with_masks(r, r.o) if ran[2].failure is None else None
    if made is None:
        return ran
    given_again(r, r.notes)
    return made


def lined_again(r: RunSoFar, run: TraceRun, ran: Made, lined: LineUp) -> tuple[Made, LineUp]:
    """After a reading of the line-up that changed the options (the column form): the code run with its masks under
    them, kept where it lines up no worse than without them; the run's words then say so."""
    from attnscope.usertrace.lineup import line_up
    from attnscope.usertrace.ranking import better_fit

    made = with_masks(r, r.o) if ran[2].failure is None else None
    if made is None:
        return ran, lined
    tried = line_up(r.weighted, r.shapes, made[0], made[2].records, r.o.train, r.spec)
    if tried.no_reference is not None or better_fit(lined, tried):
        return ran, lined
    given_again(r, r.first_notes)
    said_anew(r, run, made)
    return made, tried


def said_anew(r: RunSoFar, run: TraceRun, made: Made) -> None:
    """The run's notes, header and parameters said anew for `made`, a run that ran, kept by a reading of the
    line-up (time-first inputs, the masks given again)."""
    from attnscope.runs.trace_result import run_header, run_params
    from attnscope.usertrace.inputs import plan_notes

    inputs, _, _, convention = made
    run.notes[:] = r.first_notes + inputs.notes + plan_notes(r.plan, inputs)
    if convention is not None:
        run.notes.append(convention.note(r.plan.mask or "mask"))
    run.header = run_header(r.target, r.label, r.plan, inputs, r.mode, r.spec)
    run.header[-1] += "" if r.o.q else f"  seed={r.o.seed}"
    run.params, run.failure, run.failure_source = run_params(r.o, r.target, r.kwargs, inputs), None, None


def with_masks(r: RunSoFar, asked: TraceOptions) -> Made | None:
    """The code run with the masks left at their default under other options than `asked`, under `asked`, where it
    runs; None otherwise (r.plan stays as it is either way: given_again keeps the masks)."""
    if r.masked is None or asked == r.masked[1]:
        return None
    bare, r.plan = r.plan, r.masked[0]
    try:
        made = attempted(r.attempt, asked)
    finally:
        r.plan = bare
    return made if made is not None and made[2].failure is None else None


def given_again(r: RunSoFar, notes: list[str]) -> None:
    """The masks left at their default given again under r.o, as with_masks ran them: the plan theirs, the note that
    left them in `notes` replaced by one that says so; no later reading gives them again."""
    assert r.masked is not None
    dropped, said = r.masked[2], _note(r)
    notes[:] = [said if n == dropped else n for n in notes]
    r.plan, r.masked = r.masked[0], None


def _note(r: RunSoFar) -> str:
    """The note for masks given again: the inputs the code raised with them on, those it runs with them on."""
    assert r.masked is not None
    plan, first, _, where = r.masked
    given = [m for m in (plan.mask, *plan.other_masks) if m is not None]
    what = f"the --mask file given to {plan.mask}" if r.o.mask else f"trace's mask given to {plan.mask}"
    return (f"{', '.join(given)}: your code raised with {what} on {_fed(first)} ({where}) and runs with "
            f"{'them' if len(given) > 1 else 'it'} on {_fed(r.o)}: given there, as your code reads "
            f"{'them' if len(given) > 1 else 'it'}")


def _fed(o: Any) -> str:
    """How the options hand the inputs, in words."""
    laid = LAYOUTS.get(o.layout, o.layout)
    return f"{laid}, one tensor for all three" if o.one_input else laid
