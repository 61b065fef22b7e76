"""A mask the code takes in several forms, each given once the first lines up: a user calls such code with whichever
form they hold, and a branch on the mask's rank that trace's first form never reaches hides its mistakes (HF
Pix2Struct's `if attention_mask.dim() == 2: ... attention_mask[:, None, None, :]` beside `else: ... + attention_mask`,
BERT's get_extended_attention_mask: 2-D or 3-D). runs/trace_readings.py calls `other_forms` after its readings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from attnscope.runs.trace_attempt import Made, RunSoFar
    from attnscope.runs.trace_result import TraceRun
    from attnscope.usertrace.call import Called
    from attnscope.usertrace.lined import LineUp


def other_forms(r: RunSoFar, run: TraceRun, ran: Made, lined: LineUp) -> tuple[Made, LineUp]:
    """Where the run lines up and its mask is one trace can write in other shapes (maskranks.forms: key padding
    `[n_batch, n_K]`, `[n_batch, 1, n_K]`, 4-D, a mask per query), the code given the mask in each other shape it takes
    (one it runs on, fed well, in the convention it was read in, else the first other that keeps to the mask: HF's 2-D
    0/1 beside a 4-D bias) and takes along another path than the first (maskranks.path: a branch on the mask's shape),
    keeping the rule the code applied by itself in the first run (maskranks.keeps_own); the first whose output differs
    from the first run's and whose line-up diverges is kept, its divergence saying the form. Else the run as it was.
    Forms the code raises on are none it takes. Not tried where another mask parameter was given a part of the mask
    beside this one (the plan and feeds of that run are its own)."""
    import torch

    from attnscope.usertrace import masking, maskranks
    from attnscope.usertrace.lineup import line_up

    inputs, fed, called, convention = ran
    plan = r.plan
    allowed = inputs.allowed
    if lined.divergence is not None or lined.no_reference is not None or called.failure is not None \
            or convention is None or plan.mask is None or allowed is None or allowed.dtype != torch.bool \
            or bool(allowed.all()) or r.o.layout != "row" or plan.heads_folded or plan.fed_by_lengths() \
            or inputs.also_masked:  # another mask parameter given a part (trace_mask._rule_beside): that run's own
        return ran, lined
    first = maskranks.path(called.records, plan.mask)
    for form, shape in maskranks.forms(allowed, inputs.sizes):
        tried = _given(r, ran, form)
        if tried is None:
            continue
        again, kind = tried
        if maskranks.path(again.records, plan.mask) == first or maskranks.agree(called.result, again.result) \
                or not maskranks.keeps_own(called, again, allowed, inputs.sizes):
            continue
        other = line_up(r.weighted, r.shapes, inputs, again.records, r.o.train, r.spec)
        if other.divergence is None or other.no_reference is not None:
            continue
        given = maskranks.words(tuple(allowed.shape), inputs.sizes)
        said = masking.WORDS.get(kind, kind)
        run.notes.append(f"{plan.mask}: your code takes it in more than one form, along other ops for each; given "
                         f"{given}, it lines up with the reference; given {shape}, {said}, the same mask, it does "
                         "not: that run is the one shown")
        other.divergence.diagnosis = f"with the mask given as {shape}, {said}: {other.divergence.diagnosis}"
        inputs.allowed = form
        read = convention if kind == convention.kind else masking.Convention(
            kind, convention.line, f"given {shape}, found by experiment")
        return (inputs, fed, again, read), other
    return ran, lined


def _given(r: RunSoFar, ran: Made, form: Any) -> tuple[Called, str] | None:
    """The code run on the mask `form` (True = may attend): in the convention it was read in, where that run is fed
    well, masks no query's every key (maskforms.drowned) and keeps to the mask (or whether it does cannot be read),
    a query the mask leaves no key read in none of these (maskrows.keyless: its row is the code's convention);
    else the first other convention (maskforms.FORMS) whose run does (HF's 2-D 0/1 mask beside its 4-D bias); else
    the run in the convention read, where it is fed well and some query keeps a key (the form's own mistake: a key
    padding applied on the queries drowns the padded queries' rows alone); None where the code raises on every one,
    none is fed well, or it broadcasts the form into other shapes than the first run's (maskranks.shaped_alike)."""
    import torch

    from attnscope.runs.trace_mask import fed_well
    from attnscope.usertrace import heldcache, maskforms, masking
    from attnscope.usertrace.call import call
    from attnscope.usertrace.maskranks import shaped_alike
    from attnscope.usertrace.maskrows import keyless, laid

    inputs, fed, first, convention = ran
    assert convention is not None
    plan, o = r.plan, r.o
    label = plan.mask or "mask"
    grid = laid(inputs.allowed, inputs.sizes) if inputs.allowed is not None else None  # [n_batch, n_Q, n_K]
    rows = keyless(form, inputs.sizes)  # queries the mask leaves no key: their rows are the code's, not read
    dtype = next(iter(inputs.tensors.values())).dtype
    kinds = maskforms.in_turn(convention.kind)
    fallback: tuple[Called, str] | None = None
    for i, kind in enumerate(kinds):
        try:
            mask = masking.written(form, kind, dtype, convention.line)
        except UsageError:
            continue
        if r.own_cache is not None and inputs.cache is not None:
            heldcache.fill(r.own_cache, inputs.cache, inputs.sizes["n_Q"])
        torch.manual_seed(o.seed)
        tried = call(r.target, r.fn, plan, inputs, r.module, o.max_memory, mask, fed)
        if tried.failure is not None or not fed_well(tried, rows) or not shaped_alike(first, tried):
            continue
        drowned = maskforms.drowned(tried.records, label, rows=rows)  # every key of a query very negative
        held = masking.holds(tried.records, grid, inputs.sizes)
        if not drowned and (held is True or (i == 0 and held is None)):
            return tried, kind
        if i == 0 and not maskforms.drowned(tried.records, label, every=True, rows=rows):
            fallback = tried, kind  # the convention read, whatever it holds: the form's own mistake, unless another
            # keeps to the mask (every query drowned: a convention of the form's own, none of them kept)
    return fallback

