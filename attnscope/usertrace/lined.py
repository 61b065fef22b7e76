"""What a line-up is: each step of the reference with the user's tensor lined up with it (Aligned), the first step
that has no equal and its cause (Divergence), and the whole, with the reference's run and the notes (LineUp).

Statuses: `equal` (same layout), `permuted` (another layout, reported), `differs` (a tensor of the
step's shape, other values), `missing` (no tensor of its shape), `unseen` (missing, but a later step is
equal: fused away, as in F.scaled_dot_product_attention). The first `differs` or `missing` is the
divergence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnscope.trace import Trace
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Spec

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
    order: tuple[int, ...] | None = None  # the layout: how the user's tensor permutes the step's axes
    merged: bool = False  # ... and merges neighbours of them
    split: tuple[int, int, int] | None = None  # ... after viewing one of them as two (align.Layout)


@dataclass
class Divergence:
    reference: str
    record: Record | None
    ratio: float | None
    diagnosis: str
    experiment: str | None = None  # the catalog entry whose rerun reproduced the user's tensors (experiments.py)
    evidence: str | None = None  # what that rerun reproduced, in words
    # an earlier step the experiment's rerun changed that the code holds, where the line-up found no tensor for it:
    # (step, the code's tensor, the diagnosis and evidence said of that tensor); placed there once the reading is
    # chosen (shown_earlier), never while readings are compared by how far they line up
    earlier: tuple[str, Record, str, str] | None = None

    def names(self, entry: str) -> bool:
        """Whether the experiment that explains it is `entry`, alone or one of two ("rope.not_applied+scale.d_head")."""
        return self.experiment is not None and entry in self.experiment.split("+")


@dataclass
class LineUp:
    reference: str = ""  # what the reference is, in words
    rows: list[Aligned] = field(default_factory=list)
    divergence: Divergence | None = None
    no_reference: str | None = None  # why there is none
    notes: list[str] = field(default_factory=list)
    trace: Trace | None = None  # the reference's run
    n_kv_head: int | None = None  # the reference's key/value heads (read from the weights once the code ran)
    spec: Spec | None = None  # what the reference computed: the options' spec, or a convention read from the code
    joint: bool = False  # the reference starts from the code's q, k, v joined from streams (joint.py)


def shown_earlier(lined: LineUp, records: list[Record] | None = None) -> None:
    """The divergence moved to the earlier step its experiment's rerun changed and the code holds (Divergence.earlier),
    where the line-up still has no tensor for that step (unseen, missing) and the divergence's step is computed from
    it directly: the mistake shows there first, said of the code's tensor there (DeepSeek-V2's q_pe turned
    half-split, not the query it is joined into). Where the line-up paired that step with another tensor of the
    code's (equal or permuted), it moves only where that tensor is one the rerun's is computed from, and the
    rerun's one the divergence's is computed from (`records`): a tensor before the step's own, on the way to it,
    is not the step, whatever its numbers (a correct tensor of the code's that it never uses, Idefics2's values
    from the keys beside its unused v, stays the line-up's)."""
    import re

    from attnscope.usertrace.align import ancestors, compare

    d = lined.divergence
    if d is None or d.earlier is None or lined.trace is None:
        return
    name, record, text, evidence = d.earlier
    names = [row.reference for row in lined.rows]
    if name not in names or d.reference not in names or names.index(name) >= names.index(d.reference):
        return
    row = lined.rows[names.index(name)]
    # the step the divergence is computed from directly, in the reference's run (latent attention's Q_full joins
    # Q_nope and Q_pe_rot): a mistake further up is said where the line-up found it, as before
    step = lined.trace.step(d.reference)
    direct = name in step.inputs or re.search(rf"\b{re.escape(name)}\b", step.op) is not None  # its op names it
    if not direct or row.status not in ("unseen", "missing", *ALIGNED):
        return
    # an aligned row gives way only to a tensor made from its own on the way to the divergence's; never for a
    # scale's mistake, said at the scores where the reference scales: code may scale its q first as its own
    # convention (Swin's `q = q * self.scale`), and the q it scaled is then not where it went wrong
    if row.status in ALIGNED and (records is None or d.record is None or row.record is None
                                  or (d.experiment or "").startswith("scale.")
                                  or record.index not in ancestors(d.record, records)
                                  or row.record.index not in ancestors(record, records)):
        return
    shown = compare(record, lined.trace[name], None)[:1]  # a step before the divergence: before any masked rows
    if not shown:
        return
    step = lined.trace.step(name)
    row.status, row.record, row.max_abs_diff = "differs", record, shown[0].max_abs_diff
    row.layout = shown[0].layout.describe(step.dims, tuple(record.tensor.shape))
    row.order, row.merged, row.split = shown[0].layout.order, shown[0].layout.merged, shown[0].layout.split
    d.reference, d.record, d.ratio, d.diagnosis, d.evidence = name, record, None, text, evidence
