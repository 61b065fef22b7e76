"""Run the reference on the user's inputs (and weights), find each of its steps among the user's tensors,
and explain the first step that has no equal.

Statuses: `equal` (same layout), `permuted` (another layout, reported), `differs` (a tensor of the
step's shape, other values), `missing` (no tensor of its shape), `unseen` (missing, but a later step is
equal: fused away, as in F.scaled_dot_product_attention). The first `differs` or `missing` is the
divergence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError

if TYPE_CHECKING:
    import torch

    from attnscope.trace import Trace
    from attnscope.usertrace.inputs import Inputs, ShapePlan
    from attnscope.usertrace.record import Record

ALIGNED = ("equal", "permuted")


@dataclass
class Aligned:
    reference: str
    dims: tuple[str, ...]
    shape: list[int]
    record: Record | None
    layout: str  # "" when the same layout, else how the user's tensor lays the step out
    max_abs_diff: float | None
    status: str  # equal | permuted | differs | missing | unseen


@dataclass
class Divergence:
    reference: str
    record: Record | None
    ratio: float | None
    diagnosis: str


@dataclass
class LineUp:
    reference: str = ""  # what the reference is, in words
    rows: list[Aligned] = field(default_factory=list)
    divergence: Divergence | None = None
    no_reference: str | None = None  # why there is none
    notes: list[str] = field(default_factory=list)


def line_up(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool) -> LineUp:
    from attnscope.usertrace import reference as ref
    from attnscope.usertrace.align import candidates, compare
    from attnscope.usertrace.diagnose import Context, diagnose

    out = LineUp()
    Q, K, V = inputs.qkv()
    projections = None
    try:
        if module is not None:
            if shapes.n_head is None:
                out.no_reference = shapes.why_no_heads
                return out
            reference_module, projections = ref.build_mha(module, shapes.n_head)
            trace = ref.run_mha(reference_module, Q, K, V, inputs.mask)
            wanted: tuple[str, ...] = ref.MHA_STEPS
            out.reference = (f"attnscope MultiHeadAttention (d_feat={reference_module.d_feat}, n_head="
                             f"{shapes.n_head}, d_head={reference_module.d_head}, scores / √d_head) holding your "
                             f"weights: {projections.describe()}")
        else:
            trace = ref.run_sdpa(Q, K, V, inputs.mask)
            wanted = ref.SDPA_STEPS
            out.reference = "attnscope sdpa: out = softmax(Q Kᵀ / √d_K) V"
    except UsageError as exc:
        out.no_reference = str(exc)
        return out
    skips = _skips(trace)
    if skips:
        out.notes.append("some queries may attend to no key: attnscope gives them zeros, hand-written code often "
                         "a uniform average or NaN; those rows are left out of the comparison")
    out.rows = _align(trace, wanted, records, skips)
    first = next((row for row in out.rows if row.status in ("differs", "missing")), None)
    if first is None:
        return out
    ctx = Context("module" if module is not None else "function", inputs.sizes, trace, records, inputs.mask,
                  train, projections, skips)
    tensor, skip = trace[first.reference], skips.get(first.reference)
    found = diagnose(first.reference, ctx, candidates(records, tensor, first.reference, skip, _anchor(out.rows)))
    out.divergence = Divergence(first.reference, found.record or first.record, found.ratio, found.text)
    shown = compare(found.record, tensor, skip)[:1] if found.record is not None else []
    if found.record is not None and shown:  # the row shows the tensor the diagnosis speaks of
        step = trace.step(first.reference)
        first.record, first.max_abs_diff = found.record, shown[0].max_abs_diff
        first.layout = shown[0].layout.describe(step.dims, tuple(found.record.tensor.shape))
    return out


def _anchor(rows: list[Aligned]) -> int:
    """The user's tensor that matched the last step before the divergence (-1 when none did)."""
    anchor = -1
    for row in rows:
        if row.status not in ALIGNED:
            break
        if row.record is not None:
            anchor = row.record.index
    return anchor


def _align(trace: Trace, wanted: tuple[str, ...], records: list[Record],
           skips: dict[str, torch.Tensor]) -> list[Aligned]:
    from attnscope.usertrace.align import best_equal, closest

    rows: list[Aligned] = []
    anchor = -1
    for name in (n for n in wanted if n in trace):
        step, skip = trace.step(name), skips.get(name)
        match = best_equal(records, step.tensor, skip) or closest(records, step.tensor, name, skip, anchor)
        if match is None:
            rows.append(Aligned(name, step.dims, list(step.shape), None, "", None, "missing"))
            continue
        if match.equal:
            anchor = match.record.index
        status = ("equal" if match.layout.same else "permuted") if match.equal else "differs"
        rows.append(Aligned(name, step.dims, list(step.shape), match.record,
                            match.layout.describe(step.dims, tuple(match.record.tensor.shape)),
                            match.max_abs_diff, status))
    for i, row in enumerate(rows):  # a step fused away (F.scaled_dot_product_attention) is not a divergence
        if row.status == "missing" and any(r.status in ALIGNED for r in rows[i + 1:]):
            row.status = "unseen"
    return rows


def _skips(trace: Trace) -> dict[str, torch.Tensor]:
    """Per step from the masked scores on, the rows of queries that may attend to no key, shaped to
    broadcast against the step: attnscope gives them zeros where hand-written code differs, so they are
    left out of the comparison. Empty when there are none."""
    if "masked_scores" not in trace:
        return {}
    import torch

    scores = trace.step("masked_scores")
    empty = torch.isneginf(scores.tensor).all(-1)  # [.., n_Q], dims scores.dims[:-1]
    if not bool(empty.any()):
        return {}
    row_dims = scores.dims[:-1]
    skips: dict[str, torch.Tensor] = {}
    after = False
    for step in trace.steps:
        after = after or step.name == "masked_scores"
        if not after or "n_Q" not in step.dims:
            continue
        rows = empty
        for axis in reversed(range(len(row_dims))):  # fold the axes the step does not have (n_head after the merge)
            if row_dims[axis] not in step.dims:
                rows = rows.any(axis)
        kept = [d for d in row_dims if d in step.dims]
        if tuple(step.dims[: len(kept)]) == tuple(kept):
            skips[step.name] = rows.reshape(*rows.shape, *[1] * (len(step.dims) - len(kept)))
    return skips
