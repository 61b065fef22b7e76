"""`attnscope trace` between parsing and rendering: import the user's callable, feed it, record every op,
run the reference on the same inputs, line the two up and explain the first divergence.

No terminal code: `run_trace` returns a `TraceRun` that attnscope.render.usertrace shows. The run's steps live
beside this file: trace_setup (the target built, its forward planned), trace_attempt (the run so far, and how
each run of the code is made), trace_mask (the mask as the code reads it), trace_maskranks (the mask in the code's
other forms, once the first lines up), trace_layouts (the first run, and the readings where it raises),
trace_readings (what a run that ran says), trace_result (the record); the pieces they use live in
attnscope.usertrace (load, inputs, call, lineup).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from attnscope.errors import UsageError
from attnscope.runs.trace_layouts import HeadsForCache, first_run
from attnscope.runs.trace_options import TraceOptions
from attnscope.runs.trace_readings import read_run, recorded
from attnscope.runs.trace_result import TraceRun, run_steps
from attnscope.runs.trace_setup import prepare

if TYPE_CHECKING:
    from attnscope.usertrace.load import Plan

ONE_THREAD_ROWS = 64  # a run on at most this many rows (n_batch x tokens) of trace's own inputs: one torch thread


def run_trace(o: TraceOptions) -> TraceRun:
    """The run, on one torch thread where trace makes small inputs itself: its plans, reruns and experiments are
    hundreds of small operations, where a second thread only adds hand-offs and, on a busy machine, waits for a
    core (the trace tests' slowest style, 7.3-9.5 s on two threads against 5.5 s on one at a load of 8;
    docs/performance.md, tensors/threads.py). Your code and the reference run on the same count, so they sum alike."""
    from attnscope.tensors.threads import one_thread
    from attnscope.usertrace.maskfit import unbatched_file

    unbatched = unbatched_file(o)  # --batch 0 with a file of several sequences: said before anything is run
    if unbatched is not None:
        raise UsageError(unbatched)
    given = o.q or o.k or o.v
    rows = (o.batch or 2) * (max(o.nq or 0, o.nk or 0, 8) + o.cache)
    with one_thread(not given and rows <= ONE_THREAD_ROWS):
        try:
            return _run_both(o)
        except HeadsForCache as unknown:
            return _heads_then_cache(o, unknown.name, unknown.batches)


def _heads_then_cache(o: TraceOptions, name: str, batches: tuple[int | None, ...] = ()) -> TraceRun:
    """The code run without its cache first, as a prefill (every reading of trace's: time-first inputs, layouts),
    its head count read from the queries it hands the scores; then the decode step with that count, as --heads would
    give it (ChatGLM's SelfAttention keeps it as num_attention_heads_per_partition, which no rule reads). A module
    that holds its cache is run at each batch size its cache may hold until one runs (torchtune's KVCache, allocated
    for a batch of its own)."""
    for batch in batches or (o.batch,):
        prefill = _run_both(dataclasses.replace(o, cache=0, batch=batch))
        if prefill.failure is None:
            break
    heads = prefill.params.get("sizes", {}).get("n_head") if prefill.params else None
    if prefill.failure is not None or not isinstance(heads, int):
        raise UsageError(f"cannot tell how many heads {name} has, which the keys and values of --cache "
                         f"{o.cache} are drawn with; pass --heads")
    run = _run_both(dataclasses.replace(o, heads=heads))
    run.notes.insert(min(1, len(run.notes)), f"n_head = {heads}, read from a run of your code without the cache (the "
                     "queries it hands the scores), so that the cache of the decode step has its shape; nothing in "
                     "the module says it (--heads does)")
    return run


def _run_both(o: TraceOptions) -> TraceRun:
    """For code that says a head count (usertrace/identity.py), read as splitting the heads itself unless it reads,
    by its tensors, as taking them split already."""
    split = _run_trace(o, True)
    if split.split_heads is None or (split.failure is None and split.no_reference is None and (
            split.divergence is None or split.divergence.experiment is not None)):
        return split  # lined up, or a mistake of the catalog reproduced: the heads are the code's to split
    try:
        whole = _run_trace(o, False)
    except UsageError:
        return split
    from attnscope.usertrace.identity import split_better

    return split if split_better(split, whole) else whole


def _run_trace(o: TraceOptions, split: bool) -> TraceRun:
    """One reading of the code (`split`: its heads split by itself or given split): prepared, run, its first run
    recorded, read, and its steps named."""
    r = prepare(o, split)
    made = first_run(r)
    run = recorded(r, made)
    inputs, fed, called, _ = read_run(r, run, made)
    run.steps = run_steps(inputs, called.records, run.alignment, fed, r.plan)
    _unfed_mask(r.o, r.plan, run)
    if r.o.save and called.failure is None and run.no_reference is None:
        from attnscope.tensors import save_tensors
        from attnscope.usertrace.saving import saved_steps

        tensors, meta = saved_steps(run.alignment, inputs, r.target)
        run.saved = save_tensors(tensors, r.o.save, force=r.o.force, metadata=meta, option="--save")
    return run


def _unfed_mask(o: TraceOptions, plan: Plan, run: TraceRun) -> None:
    """Refused where a --mask file went to no argument of the code, a parameter defaulting to None that trace does
    not read as a mask (by its name, or by its use: usertrace/maskuse.py) was left None, and the code diverges with
    no experiment of the catalog to say why, or only `mask.not_applied` (the file applied by nothing): the divergence
    is then the file's, not the code's."""
    left = [n for n in plan.optional if n not in plan.given]
    # the mask never applied (mask.not_applied) is the file's own story where no argument took it, no cause
    unexplained = run.divergence is not None and (run.divergence.experiment is None
                                                  or run.divergence.names("mask.not_applied"))
    if o.mask and plan.refused is not None and unexplained:
        _refused(o.mask, plan.refused)
    if not o.mask and (o.causal or o.window) and plan.refused is not None and unexplained:
        _refused_rule(o, plan.refused)  # trace's own mask, raised on in every shape: never mask.not_applied by default
    if not o.mask or plan.mask is not None or plan.other_masks or plan.masks_at_default or plan.lengths is not None \
            or not left or not unexplained:
        return
    from pathlib import Path

    raise UsageError(f"--mask {Path(o.mask).name} was given to no argument of {plan.signature}: trace hands a mask "
                     "to an argument named like a mask (mask, attn_mask, attention_mask, key_padding_mask, ...: "
                     "\"mask\" in its name), else to one your code applies to its scores or weights when given it "
                     f"(masked_fill, where, added to them, multiplying them), and {', '.join(left)} is neither, so "
                     "your code ran without it; name the argument that takes the mask with \"mask\" in it, or run "
                     "without --mask")


def _refused_rule(o: TraceOptions, refused: tuple[str, tuple[tuple[int, ...], ...], str]) -> None:
    """As _refused, for the mask trace makes of --causal or --window: the code raised on it in every shape trace
    handed it (labml's `assert mask.shape[0] == 1 or mask.shape[0] == query.shape[0]`, a form of its own), and run
    without it does not compute what the reference computes with it. No cause is named: the code was never run with
    the mask, so its masking was never seen."""
    name, shapes, why = refused
    rule = "--causal" if o.causal else f"--window {o.window}"
    tried = ", ".join(str(list(shape)) for shape in shapes)
    given = f" (as {tried})" if tried else ""
    raise UsageError(f"{rule}: your code raised on the mask trace handed to {name}{given} ({why}); run without it, "
                     f"it does not compute what the reference computes with the mask, so its masking cannot be "
                     f"traced: write the mask as {name} reads it to a file and pass --mask FILE, or run without "
                     f"{rule.split()[0]}")


def _refused(file: str, refused: tuple[str, tuple[tuple[int, ...], ...], str]) -> None:
    """The --mask file's parameter named, where the code raised on the mask in every shape trace handed it and, run
    without it, does not compute what the reference computes with it: the shapes tried, and where the code raised."""
    from pathlib import Path

    name, shapes, why = refused
    tried = ", ".join(str(list(shape)) for shape in shapes) or "none"
    raise UsageError(f"--mask {Path(file).name}: trace gave {name} the mask as {tried}, and your code raised on each "
                     f"({why}); without it your code does not compute what the reference computes with the mask: "
                     f"{name} takes the mask in none of the shapes trace writes it in (key padding, per query, "
                     "4-D, the heads folded into the batch); run without --mask")
