"""Which of two line-ups fits the user's code better: the one under another reading of the code (a convention, the
module's own bias or term, RoPE's tables of another form) or the first. No divergence, a later one
(`steps_reached`), or at the same step a cause named by experiment where the first has none, one entry above a pair
of mistakes ("a+b").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnscope.usertrace.lined import LineUp


def better_fit(other: LineUp, first: LineUp) -> bool:
    """Whether a line-up under another reading fits the code better than `first`: no divergence, a later one, or
    the same one with a cause its rerun reproduced where `first` has none (the readings of conventionread.py and
    lineup.py; RoPE's tables of another form, runs/trace.py)."""
    if other.divergence is None:
        return True
    if first.divergence is None or steps_reached(other) != steps_reached(first):
        return steps_reached(other) > steps_reached(first)
    return explained(other.divergence.experiment) > explained(first.divergence.experiment)


def explained(experiment: str | None) -> int:
    """How well a divergence is explained: no entry, two mistakes at once (pairs.py: "a+b"), one entry."""
    return 0 if experiment is None else 1 if "+" in experiment else 2


def sees(other: LineUp, best: LineUp) -> bool:
    """Whether `other`, diverging later, lines up the step where `best` diverged, or either leaves it unnamed: a
    reading that merely loses sight of a step whose mistake `best` named by experiment (heads split the wrong way,
    unseen under another pairing) goes no further."""
    named = best.divergence is not None and best.divergence.experiment is not None
    if not named or other.divergence is None or other.divergence.experiment is not None:
        return True
    assert best.divergence is not None
    return any(row.reference == best.divergence.reference and row.status in ("equal", "permuted")
               for row in other.rows)


def steps_reached(lined: LineUp) -> int:
    """How far the line-up got: the number of steps before its divergence (all of them where there is none)."""
    if lined.divergence is None:
        return len(lined.rows) + 1
    return next((i for i, row in enumerate(lined.rows) if row.reference == lined.divergence.reference), 0)
