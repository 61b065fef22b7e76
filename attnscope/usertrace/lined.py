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
