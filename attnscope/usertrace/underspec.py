"""The line-up under one spec (line_up_under): the reference run (refruns.py), each of its steps lined up with the
user's tensors (alignsteps.py), and the first step that has no equal found (firststep.py) and explained
(diagnose.py), with the notes that go with it: kernels' steps recomputed, queries that see no key, the user's
dropout in training mode.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.usertrace import keytable, scoreaxes
from attnscope.usertrace.alignsteps import align_steps, query_side
from attnscope.usertrace.firststep import anchor, before_later, return_differs, scaled_again, split_in_flow
from attnscope.usertrace.lined import ALIGNED, Divergence, LineUp
from attnscope.usertrace.refruns import reference_allowed, references

if TYPE_CHECKING:
    from attnscope.usertrace.inputs import Inputs, ShapePlan
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Spec


def line_up_under(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
                  spec: Spec | None = None) -> LineUp:
    """The line-up under `spec` as it is, no convention read (module doc); `no_reference` where none can be run."""
    from attnscope.usertrace import reference as ref
    from attnscope.usertrace.align import candidates, compare
    from attnscope.usertrace.diagnose import diagnose
    from attnscope.usertrace.diagnosis import Context
    from attnscope.usertrace.halfprec import rounding_only
    from attnscope.usertrace.rotary import after_repeat

    spec = spec or ref.Spec()
    out = LineUp()
    try:
        built = references(module, shapes, inputs, records, spec)
    except UsageError as exc:
        out.no_reference = str(exc)
        return out
    trace, wanted, reference_module, projections, out.reference, out.rows, skips, keys = built
    out.trace, out.spec = trace, spec
    out.n_kv_head = getattr(reference_module, "n_kv_head", None)
    out.joint = projections is not None and projections.joint
    if out.joint and module is not None:  # a stream's own q, k or v wrong, before the join the reference reads
        from attnscope.usertrace import joint, jointstreams

        joined = joint.find(records, dict(module.named_parameters()))
        n_head = int(reference_module.n_head)
        fault = joint.split_fault(records, joined, n_head) or jointstreams.fault(records, joined, n_head) \
            if joined is not None else None
        if fault is not None:
            return _split_fault(out, fault)
    if projections is not None and projections.note:
        out.notes.append(projections.note)
    keyed = keytable.note(spec, trace)
    if keyed is not None:
        out.notes.append(keyed)
    if train:
        from attnscope.usertrace.dropouts import with_users_dropout

        dropped = with_users_dropout(trace, records, reference_module)
        if dropped is not None:
            applied, note = dropped
            out.notes.append(note)
            if applied is not None:
                trace = out.trace = applied
                out.rows = align_steps(trace, wanted, records, skips, keys)
    if skips:
        out.notes.append("some queries may attend to no key: attnscope gives them zeros, hand-written code often "
                         "a uniform average or NaN; those rows are left out of the comparison")
    out.notes += _kernel_notes(records)
    kind = "module" if module is not None else "function"
    own = getattr(getattr(reference_module, "spec", None), "scale", None)
    if spec is not None and spec.scale is None and own is not None:  # the scale the module declares, read with its
        # reference (latentref._mscale: DeepSeek's mscale²): the experiments rerun that reference
        spec = dataclasses.replace(spec, scale=own, scale_from=f"the scale your module declares, {own:.6g}")
    ctx = Context(kind, inputs.sizes, trace, records, reference_allowed(trace),
                  train, projections, skips, spec, layout=inputs.layout, keys=keys, inputs=inputs)
    for row in out.rows:  # rotated keys never made, the repeated ones rotated instead: the same numbers, a note
        repeated_first = row.reference == "K_rot" and row.status == "unseen" and after_repeat(ctx)
        if repeated_first:
            out.notes.append(repeated_first)
    first = next((row for row in out.rows if row.status in ("differs", "missing")), None)
    if first is None:
        # every step has its equal: what the code returns must hold the last of them too (a merge after it, a
        # reshape without the permute back, is no step of the reference's)
        params = dict(module.named_parameters()) if hasattr(module, "named_parameters") else {}  # a function: none
        first, goes_on = return_differs(out.rows, trace, records, skips, set(inputs.tensors) | _handed(module), train,
                                       params) \
            if spec is None or spec.out_ops is None else (None, None)  # compared up to the merge (outops.py)
        if goes_on is not None:
            out.notes.append(goes_on)
        if first is None:
            return out
        ctx.returned = first.record
    first = split_in_flow(first, out.rows, trace, records, skips)
    first = scaled_again(first, out.rows, trace, records, skips)
    tensor, skip = trace[first.reference], skips.get(first.reference)
    used = frozenset(row.record.index for row in out.rows if row.status in ALIGNED and row.record is not None)
    turned = scoreaxes.turned(keys, trace.step(first.reference).dims)
    ranked = before_later(candidates(records, tensor, first.reference, skip, anchor(out.rows), used, turned),
                          out.rows[out.rows.index(first) + 1:], records)
    if first.reference[:1] in "KV":  # a key's or value's step is never shown at a tensor of the queries' alone
        queries_only = query_side(records)
        ranked = [m for m in ranked if m.record.index not in queries_only]
    if first.record is not None:  # the tensor where the step stands in your data flow (align_steps) is the likeliest
        chosen = first.record.index
        ranked.sort(key=lambda m: m.record.index != chosen)
    rounded = rounding_only(ctx, first.reference)
    if rounded is not None:  # the code's float16 by design: its rounding, not a mistake (halfprec.py)
        out.notes.append(rounded)
        return out
    found = diagnose(first.reference, ctx, ranked, used)  # `used`: the tensors the line-up holds for other steps
    later = next((row for row in out.rows if row.reference == found.step), None) if found.step else None
    if later is not None:  # the code never holds the first step (it masks before it scales): the later one diverges
        first.status, first.record, first.max_abs_diff, first.layout = "unseen", None, None, ""
        first.order, first.merged, first.split = None, False, None
        first = later
        first.status = "differs"
        tensor, skip = trace[first.reference], skips.get(first.reference)
    out.divergence = Divergence(first.reference, found.record or first.record, found.ratio, found.text,
                                found.experiment, found.evidence,
                                _earlier(out.rows, first, found) if later is None else None)
    shown = compare(found.record, tensor, skip)[:1] if found.record is not None else []
    if found.record is not None and shown:  # the row shows the tensor the diagnosis speaks of
        step = trace.step(first.reference)
        first.record, first.max_abs_diff = found.record, shown[0].max_abs_diff
        first.layout = shown[0].layout.describe(step.dims, tuple(found.record.tensor.shape))
        first.order, first.merged, first.split = shown[0].layout.order, shown[0].layout.merged, shown[0].layout.split
    return out


def _earlier(rows: list[Any], first: Any, found: Any) -> tuple[str, Any, str, str] | None:
    """The step before `first` whose step the named mistake's rerun changes and the code holds (Diagnosis.earlier),
    where the line-up found no tensor for it (unseen, missing) or paired it with another tensor of the code's, with
    the words said of the code's tensor there: lined.shown_earlier moves the divergence there once the reading is
    chosen (where that tensor is on the way to the divergence's). None otherwise."""
    if found.earlier is None or found.reword is None:
        return None
    name, record = found.earlier
    row = next((r for r in rows if r.reference == name), None)
    if row is None or row is first or rows.index(row) > rows.index(first) \
            or row.status not in ("unseen", "missing", *ALIGNED):
        return None
    if record is (found.record or first.record):  # the same tensor of the code's holds both: the line-up's step
        return None  # stands (Idefics2's values from the keys: V_split at its k, not V_feat at the same k)
    return (name, record, *found.reword(record))


def _split_fault(out: LineUp, fault: Any) -> LineUp:
    """The line-up of joint attention where a stream's own q, k or v is wrong before the join (joint.split_fault: its
    heads split without the transpose; jointstreams.fault): the divergence at that role's split, at the code's
    tensor, named by its experiment."""
    from attnscope.usertrace.align import difference

    step = f"{fault.role}_split"
    row = next((r for r in out.rows if r.reference == step), None)
    if row is not None:
        row.record, row.status, row.layout, row.order, row.merged, row.split = fault.split, "differs", "", None, \
            False, None
        same = out.trace is not None and tuple(out.trace[step].shape) == tuple(fault.split.tensor.shape)
        row.max_abs_diff = difference(fault.split.tensor, out.trace[step]) if same and out.trace is not None else None
        row.max_abs_diff = getattr(fault, "max_abs_diff", None) or row.max_abs_diff  # the stream's own, where said
    diagnosis, evidence = fault.words()
    out.divergence = Divergence(step, fault.split, None, diagnosis, fault.experiment, evidence)
    return out


def _kernel_notes(records: list[Record]) -> list[str]:
    """Say, once per kernel call, which steps were recomputed because it does not materialize them."""
    notes, seen = [], set()
    for record in records:
        kernel = record.details.get("recomputed")
        if kernel and (record.line, kernel) not in seen:
            seen.add((record.line, kernel))
            steps = [r.names[0].strip("()") for r in records
                     if r.details.get("recomputed") == kernel and r.line == record.line]
            notes.append(f"line {record.line}: {kernel} computes {', '.join(steps)} inside its kernel without "
                         "materializing them; they are recomputed from its arguments to line up, named in "
                         "parentheses, (scores), and its output is compared as it is")
    return notes


def _handed(module: Any) -> set[str]:
    """The names of the forward's parameters: every tensor the code is handed (a residual fed as an embedding too)."""
    import inspect

    try:
        return set(inspect.signature(module.forward).parameters) if module is not None else set()
    except (TypeError, ValueError):
        return set()
