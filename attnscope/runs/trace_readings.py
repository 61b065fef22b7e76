"""The first run recorded, then what it reads of the code once it ran: a head count only its queries say, RoPE's
pairing and share, attention sinks, key/value heads, time-first code that runs on batch-first inputs too, the column
convention, its own qk-norm and temperature, a joint attention's head width; the line-up with the reference and its
notes. Each reading that runs the code again keeps the run's words with it (`again`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from attnscope.runs.trace_attempt import RunSoFar, attempted
from attnscope.runs.trace_layouts import column_form, columns_possible
from attnscope.runs.trace_maskranks import other_forms
from attnscope.runs.trace_remask import given_again, lined_again, said_anew, with_masks
from attnscope.runs.trace_result import TraceRun, run_header, run_params
from attnscope.runs.trace_setup import with_width
from attnscope.runs.trace_tables import other_layouts

if TYPE_CHECKING:
    from attnscope.runs.trace_attempt import Made
    from attnscope.runs.trace_options import TraceOptions
    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.lined import LineUp
    from attnscope.usertrace.load import Plan, Target
    from attnscope.usertrace.reference import Spec


def recorded(r: RunSoFar, ran: Made) -> TraceRun:
    """The run as it stands after the first run and its readings: its notes, header and parameters."""
    from attnscope.usertrace import identity
    from attnscope.usertrace.inputs import keys_of_own_queries, nk_refused, plan_notes

    inputs, fed, called, convention = ran
    if r.o.nk is not None and r.o.nk != r.o.nq and keys_of_own_queries(r.o, r.plan, r.module is not None) and not (
            called.failure is None and "Q" in inputs.own and inputs.own_from == "module"):
        raise nk_refused(r.o, r.plan, True)  # --nk for a one-input forward whose queries are not its own after all
    if r.target.code is not None and written_elsewhere(r.target) not in r.notes:
        r.notes.insert(0, written_elsewhere(r.target))
    r.first_notes = list(r.notes)  # the module's, before those of its inputs (a second run makes them again)
    r.notes += inputs.notes + plan_notes(r.plan, inputs)
    if convention is not None and (called.failure is None or convention.line is not None):
        r.notes.append(convention.note(r.plan.mask or "mask"))  # a run that raised before its mask read nothing of it
    r.mode = "" if r.module is None or r.target.kind == "function" else \
        ", training mode" if r.o.train else ", eval() mode"
    header = run_header(r.target, r.label, r.plan, inputs, r.mode, r.spec)
    header[-1] += "" if r.o.q else f"  seed={r.o.seed}"
    run = TraceRun(header, run_params(r.o, r.target, r.kwargs, inputs), [], notes=r.notes, failure=called.failure,
                   failure_source=called.source, split_heads=r.split if identity.read(r.module) else None)
    from attnscope.usertrace import normfold

    normed = normfold.note(called.records)
    if normed is not None:  # LeViT's Linear then BatchNorm1d, read as one projection
        run.notes.append(normed)
    if not called.records:
        run.notes.append(f"no tensor operation ran from {r.target.source.name}: only ops called from that file are "
                         "recorded (torch functions, Tensor methods and operators)")
    return run


def written_elsewhere(target: Target) -> str:
    """The note for a target whose code is written in another file than the one named (load.Target.code)."""
    import os

    assert target.code is not None
    where = os.path.relpath(target.code, target.path.parent) if target.code.is_relative_to(target.path.parent) \
        else str(target.code)
    what = f"{target.name} is" if target.kind == "function" else f"{target.name}'s forward is"
    return (f"{what} written in {where}, not in {target.path.name}: its ops are recorded there, and the lines shown "
            "are that file's")


def again(r: RunSoFar, run: TraceRun) -> Made:
    """The code run again on sizes chosen anew (a size learnt from the first run), the run's words with it."""
    from attnscope.usertrace.inputs import plan_notes

    made = r.attempt(r.o)
    run.notes[:] = r.first_notes + made[0].notes + plan_notes(r.plan, made[0])
    if made[3] is not None:
        run.notes.append(made[3].note(r.plan.mask or "mask"))
    run.header = run_header(r.target, r.label, r.plan, made[0], r.mode, r.spec)
    run.header[-1] += "" if r.o.q else f"  seed={r.o.seed}"
    run.params, run.failure, run.failure_source = run_params(r.o, r.target, r.kwargs, made[0]), made[2].failure, \
        made[2].source
    return made


def read_run(r: RunSoFar, run: TraceRun, ran: Made) -> Made:
    """What the code reads as once it ran, each reading kept where it lines up further; the line-up with the
    reference, and its words, into `run`."""
    from attnscope.usertrace import idlenorms

    ran = _heads_read(r, run, ran)
    if ran[2].failure is not None:
        return ran
    ran, lined = _lined_up(r, run, ran)
    for reading in (_kv_heads, _time_first_reading, _column_reading, _own_conventions, _head_width):
        ran, lined = reading(r, run, ran, lined)
        ran, lined = lined_again(r, run, ran, lined)  # masks left at their default, given under a convention read
    ran, lined = other_layouts(r, run, ran, lined, again)  # RoPE's pair sin first, or interleaved (trace_tables)
    ran, lined = other_forms(r, run, ran, lined)  # a mask the code takes in other forms: each given (trace_maskranks)
    _said(r, run, ran, lined)
    run.notes += idlenorms.notes(r.module, ran[2], r.spec, ran[0].sizes.get("d_head"))  # v_norm held, never called
    return ran


def _heads_read(r: RunSoFar, run: TraceRun, ran: Made) -> Made:
    """The head count only the code says (a literal in its forward): read from its q, the code run again with it."""
    from attnscope.usertrace import headcount
    from attnscope.usertrace.inputs import ShapePlan

    inputs, fed, called, convention = ran
    if called.failure is None and r.weighted is not None and r.shapes.n_head is None and r.o.heads is None:
        own = inputs.own.get("Q") if inputs.own_from == "module" else None  # latents of their own width
        read = headcount.from_run(called.records, r.shapes.fixed.get("d_feat") if own is None else int(own.shape[-1]),
                               r.o.layout == "col", inputs.sizes.get("n_batch"))
        if read is not None:  # the head count only the code says (a literal in its forward): read from its q
            heads, line, laid = read
            width = r.shapes.fixed.get("d_feat")  # as the run found it (a width the weights left open, _widths)
            r.shapes = ShapePlan.make(dataclasses.replace(r.o, heads=heads), r.weighted, r.init)
            r.shapes = with_width(r.shapes, width if width != r.shapes.fixed.get("d_feat") else None)
            d_head = headcount.queries_head(called.records, heads)
            if own is not None and d_head is not None:  # d_head as the run's queries have it, not the latents' / heads
                r.shapes.fixed["d_head"] = d_head
            inputs, fed, called, convention = again(r, run)
            r.first_notes.append(f"n_head = {heads}, read from the queries your code hands the scores (line {line}: "
                               f"{laid}); nothing else in the module says it (--heads does)")
            run.notes.insert(len(r.first_notes) - 1, r.first_notes[-1])
    return inputs, fed, called, convention


def _lined_up(r: RunSoFar, run: TraceRun, ran: Made) -> tuple[Made, LineUp]:
    """RoPE's pairing and share, attention sinks read; the run lined up with the reference."""
    from attnscope.usertrace import load, sinkcols
    from attnscope.usertrace.lineup import line_up

    inputs, fed, called, convention = ran
    # real tables laid out for one pairing (not freqs_cis nor llama2.c's freqs_cos, freqs_sin: one angle a pair)
    if any(load.table_kind(name) not in load.PAIR_TABLES for name in r.plan.tables) \
            and not (r.table_form and r.table_form[0].pairs):
        # the code pairs as they are laid out, or errs (read, where --rope-pairing did not ask: refspec.pairing_read)
        r.spec = dataclasses.replace(r.spec, pairing_asked=True, pairing_read=r.spec.pairing_read or
                                     not r.spec.pairing_asked)
    r.spec = _with_own_fraction(r.spec, r.weighted, r.plan, inputs.sizes.get("d_head"), r.built)
    sunk = sinkcols.read(r.module, called.records, inputs.sizes.get("n_head"))
    if sunk is not None:  # attention sinks the module holds, joined to its scores (GPT-OSS's): its convention
        r.spec = dataclasses.replace(r.spec, sinks=sunk[0])
        r.first_notes.append(sinkcols.note(sunk[1], int(sunk[0].numel())))
        run.notes.append(r.first_notes[-1])
    lined = line_up(r.weighted, r.shapes, inputs, called.records, r.o.train, r.spec)
    return (inputs, fed, called, convention), lined


def _kv_heads(r: RunSoFar, run: TraceRun, ran: Made, lined: LineUp) -> tuple[Made, LineUp]:
    """Key/value heads read only from the run that share a size with a dim: run again with sizes that avoid it."""
    from attnscope.usertrace.lineup import line_up

    inputs, fed, called, convention = ran
    kv = lined.n_kv_head
    n_head = inputs.sizes.get("n_head")
    group = n_head // kv if kv and n_head and n_head % kv == 0 else None  # n_group
    chosen = [inputs.sizes[d] for d in ("n_batch", "n_Q", "n_K") if d in inputs.sizes]
    if kv and r.o.batch is None and kv != n_head and kv not in r.shapes.extra.values() \
            and (kv in inputs.sizes.values() or group in chosen):
        # key/value heads read only from the run (a fused projection per KV group) share a size (theirs or
        # n_group's) with a dim: run again with sizes that avoid both, so no axis is named from a coincidence
        # (n_batch for n_kv_head)
        r.shapes.extra["n_kv_head"] = kv
        inputs, fed, called, convention = again(r, run)
        if called.failure is None:
            lined = line_up(r.weighted, r.shapes, inputs, called.records, r.o.train, r.spec)
    return (inputs, fed, called, convention), lined


def _time_first_reading(r: RunSoFar, run: TraceRun, ran: Made, lined: LineUp) -> tuple[Made, LineUp]:
    """Time-first code that runs on batch-first inputs too: the reading under which it lines up further."""
    from attnscope.usertrace import timefirst
    from attnscope.usertrace.lineup import line_up

    inputs, fed, called, convention = ran
    if timefirst.early(lined) and timefirst.possible(r.o, inputs) and not _grouped(r, ran, lined) \
            and not _tuned(r, ran, lined):
        # time-first code that runs on batch-first inputs too (it then attends across the batch): the reading
        # under which it lines up further is kept (usertrace/timefirst.py)
        # (where --batch equals --nq the two readings share one shape: tried on a batch of another size)
        apart = timefirst.apart(r.o, inputs, r.shapes.extra.values())
        plan = r.plan  # an attempt keeps its plan (keep_run): the first run's again where this reading is not kept
        for time_o in timefirst.asked(r.o if apart is None else dataclasses.replace(r.o, batch=apart), inputs):
            full = with_masks(r, time_o)  # masks the code raised on before: given again, read so where it runs
            made = full if full is not None else attempted(r.attempt, time_o)
            tried = line_up(r.weighted, r.shapes, made[0], made[2].records, r.o.train, r.spec) \
                if made is not None and made[2].failure is None else None
            if made is not None and tried is not None and timefirst.better(tried, lined):
                break
        if made is not None and tried is not None and timefirst.better(tried, lined):
            batch = r.o.batch
            r.o, (inputs, fed, called, convention), lined = time_o, made, tried
            if full is not None and made is full:
                given_again(r, r.first_notes)
            r.first_notes.append(timefirst.note(None, r.weighted is not None, r.o.layout))
            if apart is not None:
                r.first_notes.append(timefirst.apart_note(batch, apart))
            said_anew(r, run, made)
        else:
            r.plan = plan
    return (inputs, fed, called, convention), lined


def _grouped(r: RunSoFar, ran: Made, lined: LineUp) -> bool:
    """Whether the code, as it ran, attends within groups it makes itself (regroup.py: Hiera's mask units, which a
    time-first reading would line up no better): read so later, never as time-first."""
    from attnscope.usertrace import regroup

    inputs, _, called, _ = ran
    return r.weighted is not None and regroup.read(r.weighted, r.shapes, inputs, called.records, r.o.train, r.spec,
                                                   lined) is not None


def _tuned(r: RunSoFar, ran: Made, lined: LineUp) -> bool:
    """Whether the code, as it ran, scales its queries by the temperature it declares (tuning.py: Mistral 4's
    `get_llama_4_attn_scale`, which a time-first reading of few positions may leave at 1): read so later, never as
    time-first."""
    from attnscope.usertrace import tuning

    inputs, _, called, _ = ran
    return r.weighted is not None and lined.divergence is not None and \
        tuning.tuned_queries(r.weighted, r.shapes, inputs, called.records, r.o.train, r.spec)


def _column_reading(r: RunSoFar, run: TraceRun, ran: Made, lined: LineUp) -> tuple[Made, LineUp]:
    """Code that runs on rows yet lines up only on columns: the column convention."""
    from attnscope.usertrace.inputs import plan_notes
    from attnscope.usertrace.lineup import line_up

    inputs, fed, called, convention = ran
    if lined.divergence is not None and columns_possible(r.o, r.weighted):
        # code that runs on rows too (weightless self-attention: Xᵀ X is [d, d] on rows) yet lines up only on
        # columns: the column convention, read from what it computes
        plan = r.plan  # as in _time_first_reading: the first run's plan again where columns are not kept
        found = column_form(r.o, r.attempt)
        col_spec = dataclasses.replace(r.spec, layout="col")
        col_lined = line_up(r.weighted, r.shapes, found[1][0], found[1][2].records, r.o.train, col_spec) \
            if found is not None else None
        if found is not None and col_lined is not None and col_lined.divergence is None \
                and col_lined.no_reference is None:
            r.o, (inputs, fed, called, convention), r.spec, lined = found[0], found[1], col_spec, col_lined
            run.notes[:] = [*r.first_notes, *inputs.notes, *plan_notes(r.plan, inputs),
                            _lined_note(r.o, called.records)]
            if convention is not None:
                run.notes.append(convention.note(r.plan.mask or "mask"))
            run.header = run_header(r.target, r.label, r.plan, inputs, r.mode, r.spec)
            run.header[-1] += "" if r.o.q else f"  seed={r.o.seed}"
            run.params = run_params(r.o, r.target, r.kwargs, inputs)
        else:
            r.plan = plan
    return (inputs, fed, called, convention), lined


def _own_conventions(r: RunSoFar, run: TraceRun, ran: Made, lined: LineUp) -> tuple[Made, LineUp]:
    """The code's own qk-norm, values' norm, temperature tuning and groups of tokens, read by experiment where the
    line-up diverges."""
    from attnscope.usertrace import ownnorm, pooled, regroup, tuning

    inputs, fed, called, convention = ran
    if lined.divergence is not None and r.o.qk_norm is None and r.weighted is not None and r.o.layout != "col":
        own = ownnorm.read(r.weighted, r.shapes, inputs, called.records, r.o.train, r.spec, lined)
        if own is not None:  # the code normalizes q and k itself: its convention, read by experiment
            r.read_notes += [note for note in own[1].notes if note not in lined.notes]
            r.spec, lined = own
            run.params["qk_norm_read"] = r.spec.qk_norm
    if lined.divergence is not None and r.weighted is not None and r.o.layout != "col":
        from attnscope.usertrace import valuenorm

        normed = valuenorm.read(r.weighted, r.shapes, inputs, called.records, r.o.train, r.spec, lined)
        if normed is not None:  # the values normed per head without weights (Gemma 3n's v_norm): its convention
            r.read_notes += [note for note in normed[1].notes if note not in lined.notes]
            r.spec, lined = normed
    if lined.divergence is not None and r.weighted is not None and r.o.layout != "col":
        tuned = tuning.read(r.weighted, r.shapes, inputs, called.records, r.o.train, r.spec, lined)
        if tuned is not None:  # Llama 4's temperature tuning, declared by the module: its convention
            r.read_notes += [note for note in tuned[1].notes if note not in lined.notes]
            r.spec, lined = tuned
    if lined.divergence is not None and r.weighted is not None:
        grouped = regroup.read(r.weighted, r.shapes, inputs, called.records, r.o.train, r.spec, lined)
        if grouped is not None:  # attention within groups the code makes itself (MobileViT's unfold): the reference
            lined = grouped[1]  # run on those groups, a note saying them
            run.notes.append(grouped[2])
    if lined.divergence is not None and r.weighted is not None:
        made = pooled.read(r.weighted, r.shapes, inputs, called.records, r.o.train, r.spec, lined)
        if made is not None:  # q, k or v pooled along the tokens after the projection (Hiera, Linformer): the
            from attnscope.usertrace.inputs import plan_notes  # reference attends over the code's pooled tensors

            stale = plan_notes(r.plan, inputs)
            inputs.sizes.update(made[0].sizes)  # n_Q or n_K theirs; sizes shared before are said anew
            fresh = plan_notes(r.plan, inputs)
            run.notes[:] = [n for n in run.notes if n not in stale or n in fresh] + [n for n in fresh
                                                                                     if n not in run.notes]
            r.spec, lined = dataclasses.replace(r.spec, pooled=made[1].spec.pooled if made[1].spec else None), made[1]
            run.notes.append(made[2])
            run.header = run_header(r.target, r.label, r.plan, inputs, r.mode, r.spec)
            run.header[-1] += "" if r.o.q else f"  seed={r.o.seed}"
            run.params["sizes"] = dict(inputs.sizes)
    if lined.divergence is not None and r.weighted is not None:
        from attnscope.usertrace import unitmask
        from attnscope.usertrace.call import call

        def probe(other: Inputs) -> list[Any] | None:  # the code run again on other inputs: its records
            again = call(r.target, r.fn, r.plan, other, r.module, r.o.max_memory, called.mask_given, fed, quiet=True)
            return again.records if again.failure is None else None

        units = unitmask.read(r.weighted, r.shapes, inputs, called.records, r.o.train, r.spec, lined, probe)
        if units is not None:  # units whose queries are not their keys (Hiera's pooled mask units): their mask
            inputs, lined = units[0], units[1]  # the reference's
            run.notes.append(units[2])
    return (inputs, fed, called, convention), lined


def _head_width(r: RunSoFar, run: TraceRun, ran: Made, lined: LineUp) -> tuple[Made, LineUp]:
    """The head width the reference's queries have where the module's widths suggested another: joint attention's
    joined q; a fused projection cut per head into widths of their own (EfficientFormer's [key_dim | key_dim |
    value_dim], d_feat / n_head none of them). The dims named again with it."""
    from attnscope.usertrace.lineup import line_up

    inputs, fed, called, convention = ran
    steps = lined.trace if lined.trace is not None and "Q_split" in lined.trace and "K_split" in lined.trace \
        and "V_split" in lined.trace else None
    width = int(steps["Q_split"].shape[-1]) if steps is not None else None
    own_widths = steps is not None and not lined.joint and r.o.layout != "col" \
        and int(steps["V_split"].shape[-1]) != width and "d_V" not in inputs.sizes  # values of a width of their own
    if width is not None and inputs.sizes.get("d_head") != width and (lined.joint or own_widths):
        # the head width the reference's queries have, not one the module's widths suggested (Flux's fused qkv read
        # as one query projection, 96 / 4 = 24; EfficientFormer's key_dim beside d_feat / n_head): dims named again
        assert steps is not None
        r.shapes.fixed["d_head"] = width
        r.shapes.fixed.pop("n_kv_head", None)
        r.shapes.fixed.pop("d_V", None)
        r.shapes.extra.pop("3·d_head", None)
        if not lined.joint and int(steps["V_split"].shape[-1]) != width:
            r.shapes.fixed["d_V"] = int(steps["V_split"].shape[-1])
        if not lined.joint and int(steps["K_split"].shape[1]) != int(steps["Q_split"].shape[1]):
            r.shapes.fixed["n_kv_head"] = int(steps["K_split"].shape[1])
        made = again(r, run)
        if made[2].failure is None:
            inputs, fed, called, convention = made
            lined = line_up(r.weighted, r.shapes, inputs, called.records, r.o.train, r.spec)
    return (inputs, fed, called, convention), lined


def _said(r: RunSoFar, run: TraceRun, ran: Made, lined: LineUp) -> None:
    """The line-up and its words into `run`."""
    from attnscope.usertrace.declared import declared_share
    from attnscope.usertrace.lined import shown_earlier

    inputs, fed, called, convention = ran
    shown_earlier(lined, called.records)  # the reading chosen: its mistake placed where it first shows (lined.py)
    run.reference, run.alignment, run.divergence = lined.reference, lined.rows, lined.divergence
    if lined.joint:  # streams joined along the tokens: one attention over all of them, whatever the inputs' kinds
        run.header[1] = run.header[1].replace(": cross-attention,", ": joint attention,", 1).replace(
            ": self-attention,", ": joint attention,", 1)
    if lined.trace is not None and "attention" in lined.trace:  # the page draws it beside the user's
        run.reference_attention = lined.trace["attention"]
    run.no_reference = lined.no_reference
    run.notes += lined.notes + [note for note in r.read_notes if note not in lined.notes]
    _after_merge(r, run, ran, lined)
    fraction = r.spec.rope_fraction if r.spec.fraction_from_module else None
    d_head = inputs.sizes.get("d_head") or 0
    share = declared_share(r.weighted, d_head, r.built) if r.spec.fraction_from_module else None
    disagree = share.disagreement(d_head) if share is not None else None
    if disagree is not None:  # the config's share against the module's attribute: the config's is the reference's
        run.notes.append(disagree)
    if r.sliced:
        run.notes += r.sliced
    elif fraction is not None and lined.spec is not None and lined.spec.rope_fraction == fraction \
            and disagree is None:
        where = share.said if share is not None else "its rotary_dim, rotary_pct or partial_rotary_factor"
        run.notes.append(f"RoPE: it rotates the first {int(d_head * fraction)} of each head's "
                         f"{d_head} coordinates (a rotary fraction of {fraction:g}), read from your "
                         f"module ({where}); the reference rotates so")


def _after_merge(r: RunSoFar, run: TraceRun, ran: Made, lined: LineUp) -> None:
    """Where every step lined up, the code's ops after its merge followed to what it returns (usertrace/aftermerge.py):
    replayed on the reference's tensor (not in training mode, nor for a module that keeps a cache between runs), a
    note where that gives the return value back, else the difference after the merge."""
    from attnscope.usertrace.aftermerge import after_merge
    from attnscope.usertrace.call import call

    inputs, fed, called, _ = ran
    if lined.divergence is not None or lined.no_reference is not None or called.failure is not None:
        return

    def rerun(index: int, tensor: Any) -> Any:
        return call(r.target, r.fn, r.plan, inputs, r.module, r.o.max_memory, called.mask_given, fed, quiet=True,
                    swap=(index, tensor))

    replay = rerun if not r.o.train and r.own_cache is None else None
    inference = None if r.o.train else "function" if r.module is None or r.target.kind == "function" else "module"
    note, differs = after_merge(called.records, lined, set(inputs.tensors), replay, inference)
    if note is not None:
        run.notes.append(note)
    if differs is not None:
        run.divergence = lined.divergence = differs


def _lined_note(o: TraceOptions, records: list[Any]) -> str:
    """The note for code that runs on rows but lines up only on columns; its scores as `records`, the run on
    columns, computes them (scoreform.said)."""
    from attnscope.usertrace import scoreform

    shape = "[n_batch, d, n]" if o.batch != 0 else "[d, n]"
    return ("your code runs on rows [.., n, d] but lines up with the reference only on columns "
            f"{shape}, one token a column: read as the column convention ({scoreform.said(records)}), a convention, "
            "not a mistake (--layout col says it)")


def _with_own_fraction(spec: Spec, module: Any, plan: Plan, d_head: int | None, made: dict[str, Any]) -> Spec:
    """The spec rotating the share of each head the module's config says RoPE turns (its rotary_dim,
    partial_rotary_factor), where --rope asks for RoPE and the module was given no tables by trace (those it was are
    read before the call, _with_own_rope); as the base read from its rope_theta, code that rotates another share
    then has a bug, named by experiment."""
    from attnscope.usertrace.declared import with_share

    if spec.rope_base is None or spec.rope_fraction is not None or plan.tables:
        return spec
    return with_share(spec, module, d_head, made)
