"""What every cause of a divergence works with (usertrace/diagnose.py tries the causes; causes.py and rotary.py
hold more of them): the context of a line-up, the diagnosis a cause gives, and the small tests they share (who a
record is, a match in the reference's layout, two tensors equal within tolerance).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from attnscope.usertrace.align import difference, tolerance

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnscope.trace import Trace
    from attnscope.usertrace.align import Match
    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Projections, Spec


@dataclass
class Context:
    kind: str  # "module" or "function"
    sizes: dict[str, int]
    reference: Trace
    records: list[Record]
    mask: torch.Tensor | None = None
    train: bool = False
    projections: Projections | None = None
    skip: dict[str, torch.Tensor] = field(default_factory=dict)
    spec: Spec | None = None
    comparing: bool = False  # `attnscope diff`: the reference is run A, the user's tensors are run B's
    layout: str = "row"  # how the code's inputs were laid out (inputs.InputOptions.layout: row, col, time, bthd)
    returned: Record | None = None  # what the code returned, where it is the divergence: an experiment's run must
    # give it back (rerun.reproduces), whatever inner tensor of the code holds the run's last step
    keys: dict[int, int] = field(default_factory=dict)  # record -> the axis holding the keys, where the data flow
    # says it (scoreaxes.key_axes): square scores held the other way round line up so
    inputs: Inputs | None = None  # the run's inputs (Inputs.qkv(): the inputs as the reference reads them)


@dataclass
class Diagnosis:
    text: str
    record: Record | None = None
    ratio: float | None = None
    experiment: str | None = None  # the catalog's entry whose rerun reproduced the user's tensors (experiments.py)
    evidence: str | None = None  # what the experiment reproduced, in words (shown on a line of its own)
    # the later step the experiment reproduced the divergence at, where the code never holds the line-up's first
    # (diagnose.HELD_LATER: code that masks before it scales never holds the scaled scores unmasked); None: that one
    step: str | None = None
    # an earlier step the experiment's rerun changed that the code holds, with the code's tensor: where the line-up
    # lost sight of it (unseen, missing), the mistake shows there first (underspec._earlier, lined.shown_earlier)
    earlier: tuple[str, Record] | None = None
    # the words and the evidence said of another tensor of the code's (the earlier one): by_experiment's own phrasing
    reword: Callable[[Record | None], tuple[str, str]] | None = field(default=None, repr=False, compare=False)


def label_of(record: Record) -> str:
    """How a diagnosis names the tensor: `your scores (line 31)`, or what the record says (diff: `B's scores`)."""
    return str(record.details.get("who") or f"your {record.label} (line {record.line})")


def in_reference_layout(near: Match, step: str, ctx: Context) -> torch.Tensor:
    return near.layout.undo(near.record.tensor, tuple(ctx.reference[step].shape)).double()


def close(user: torch.Tensor, expected: torch.Tensor) -> bool:
    return tuple(user.shape) == tuple(expected.shape) and \
        difference(user, expected) <= tolerance(expected, torch.float32)


def equal_record(records: list[Record], expected: torch.Tensor) -> Record | None:
    """The first user tensor that is `expected` (its shape, its numbers within tolerance)."""
    return next((record for record in records if close(record.tensor, expected)), None)
