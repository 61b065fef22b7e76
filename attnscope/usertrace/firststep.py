"""Which step diverges first, and at which of the user's tensors, once the steps are lined up: where every step has
its equal, what the call returns (return_differs); a step before the first one rearranged wrongly on the way to it
(split_in_flow); the scores scaled again (scaled_again); the tensors a divergence may be shown at (before_later),
and the last one lined up before it (anchor).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnscope.usertrace.alignsteps import parents
from attnscope.usertrace.lined import ALIGNED

if TYPE_CHECKING:
    import torch

    from attnscope.trace import Trace
    from attnscope.usertrace.align import Match
    from attnscope.usertrace.lined import Aligned
    from attnscope.usertrace.record import Record

FINAL = ("x", "x_rsh2", "out")  # the steps a call's result holds: the module's output (its merge without W_o), sdpa's


def anchor(rows: list[Aligned]) -> int:
    """The user's tensor that matched the last step before the divergence (-1 when none did)."""
    last = -1
    for row in rows:
        if row.status not in ALIGNED:
            break
        if row.record is not None:
            last = row.record.index
    return last


def return_differs(rows: list[Aligned], trace: Trace, records: list[Record], skips: dict[str, torch.Tensor],
                   given: set[str], train: bool, params: dict[str, Any] | None = None
                   ) -> tuple[Aligned | None, str | None]:
    """The last step, lined up with what the code returned, where the line-up found that step inside the code (its
    `attn @ v`) but the tensor the call hands back holds it in no layout (`out.reshape(B, M, H, K)` with the permute
    back forgotten): the row, now at the returned tensor and `differs`. None where a returned tensor holds it, or
    where nothing returned has its size (the code returns something else: its weights alone, a cache); and where the
    code goes on from the last step as a block does, joining another tensor to it (a residual of its input `given`,
    then a norm) or dropping out in training mode, None and a note saying so. Ops on the last step alone (a scale,
    the projection twice) are no block: the return is then the divergence; a learned per-channel gain of the
    module's own (LayerScale's, `params`), confirmed by experiment, is a convention and a note (outgain.py)."""
    from attnscope.usertrace import outgain
    from attnscope.usertrace.align import REARRANGING, ancestors, compare, tolerance
    from attnscope.usertrace.outterm import from_pattern

    final = next((row for row in reversed(rows) if row.reference in FINAL and row.status in ALIGNED
                  and row.record is not None), None)
    if final is None or final.record is None:
        return None, None
    step = trace[final.reference]
    returned = sorted((r for r in records if "returned" in r.details and r.tensor.is_floating_point()
                       and r.tensor.numel() == step.numel()), key=lambda r: r.details["returned"])
    if not returned:
        return None, None
    skip = skips.get(final.reference)
    for record in returned:
        tol = max(tolerance(step), tolerance(step, record.tensor.dtype))  # a result cast back to half precision
        if record.index == final.record.index or any(m.equal for m in compare(record, step, skip, tol=tol)):
            return None, None
    record = returned[0]
    gain = outgain.read(final.record, record, records, params or {}, step, skip, final.reference)
    if gain is not None:
        return None, gain
    held = final.record.index
    above = ancestors(record, records)
    if held in above:
        between = [r for r in records if held < r.index <= record.index and (r.index in above or r is record)
                   and held in ancestors(r, records)]
        on_path = {r.index for r in between} | {held}
        # a term made from the attention weights (Shaw's relative values, `attn · a_V`) is no block's: outterm.py's
        pattern, output = (next((row.record.index for row in rows if row.reference == name
                                 and row.record is not None and row.status in ALIGNED), None)
                           for name in ("attention", "x_raw"))
        joined = next((r for r in between if r.func not in REARRANGING and (
            _reads_input(r, given) or any(p not in on_path and not from_pattern(records[p], pattern, records, output)
                                          for p in r.parents)
            or (train and r.func == "dropout"))), None)
        if joined is not None:  # a residual and a norm, a gate: a block goes on from the attention's output
            return None, (f"your code goes on after {final.reference}: your {record.label} (line {record.line}), "
                          f"what it returns, is computed from your {final.record.label} (line {final.record.line}) "
                          f"and more (line {joined.line}: {joined.details.get('op', joined.call)}), as a block's "
                          f"residual, norm or dropout; it is compared up to {final.reference}")
    matches = compare(record, step, skip)
    final.record, final.status = record, "differs"
    final.max_abs_diff = matches[0].max_abs_diff if matches else None
    final.layout = matches[0].layout.describe(trace.step(final.reference).dims, tuple(record.tensor.shape)) \
        if matches else ""
    final.order, final.merged, final.split = (matches[0].layout.order, matches[0].layout.merged,
                                              matches[0].layout.split) if matches else (None, False, None)
    return final, None


def _reads_input(record: Record, given: set[str]) -> bool:
    """Whether one of the record's arguments is an input of the call, by its label (`out + hidden_states`)."""
    return any(kind == "text" and value in given for kind, value in record.args) or any(
        kind == "kw" and value[1][0] == "text" and value[1][1] in given for kind, value in record.args)


def before_later(ranked: list[Match], later: list[Aligned], records: list[Record]) -> list[Match]:
    """The tensors a diverging step may be shown at: none computed from a tensor a later step is paired with
    (Q_feat never at the module's return value, computed from the scores and the output)."""
    from attnscope.usertrace.align import ancestors

    held = {row.record.index for row in later if row.record is not None and row.status in (*ALIGNED, "differs")}
    if not held:
        return ranked
    return [m for m in ranked if not (ancestors(m.record, records) & held)]


def split_in_flow(first: Aligned, rows: list[Aligned], trace: Trace, records: list[Record],
                  skips: dict[str, torch.Tensor]) -> Aligned:
    """The step that really diverges, found through the user's data flow: a step `first` is computed from lines up
    with a tensor of the user's (Q_split with the projection's output, viewed), but on the way to the user's
    `first` that tensor is rearranged into one that is not the step (a view without the transpose). That step, at
    that tensor, is the divergence; else `first` is."""
    from attnscope.usertrace.align import rearranged_wrongly

    if first.record is None:
        return first
    by_step = {row.reference: row for row in rows}
    for parent in parents(first.reference, trace):
        row = by_step.get(parent)
        if row is None or row.status not in ALIGNED or row.record is None:
            continue
        step = trace.step(parent)
        found = rearranged_wrongly(records, row.record, first.record, step.tensor, skips.get(parent))
        if found is not None:
            return _differs_at(row, found, step.dims)
    return first


def scaled_again(first: Aligned, rows: list[Aligned], trace: Trace, records: list[Record],
                 skips: dict[str, torch.Tensor]) -> Aligned:
    """The scores step, where a later step diverges because the user's scores, once equal to the reference's, were
    multiplied or divided again on the way to the softmax (the scale applied twice): the scores, at the tensor
    that scaling made, are the divergence; else `first` is."""
    from attnscope.usertrace.align import rescaled

    row = next((r for r in rows if r.reference == "scores"), None)
    if row is None or row is first or row.status not in ALIGNED or row.record is None \
            or rows.index(first) < rows.index(row):
        return first
    found = rescaled(records, row.record, trace["scores"], skips.get("scores"))
    if found is None:
        return first
    return _differs_at(row, found, trace.step("scores").dims)


def _differs_at(row: Aligned, found: Match, dims: tuple[str, ...]) -> Aligned:
    """`row`, lined up now with `found`'s tensor, where the step differs."""
    row.record, row.max_abs_diff, row.status = found.record, found.max_abs_diff, "differs"
    row.layout = found.layout.describe(dims, tuple(found.record.tensor.shape))
    row.order, row.merged, row.split = found.layout.order, found.layout.merged, found.layout.split
    return row
