"""Which of two line-ups fits the user's code better: the one under another reading of the code (a convention, the
module's own bias or term, RoPE's tables of another form) or the first. No divergence, a later one
(`steps_reached`), or at the same step a cause named by experiment where the first has none, one entry above a pair
of mistakes ("a+b"). The one place that ranks line-ups: each reading asks `better_fit`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from attnscope.usertrace.lined import LineUp


def better_fit(other: LineUp, first: LineUp, *, steps: Sequence[str] | None = None,
               grade: Callable[[str | None], int] | None = None) -> bool:
    """Whether a line-up under another reading fits the code better than `first`: no divergence, a later one, or
    the same one with a cause its rerun reproduced where `first` has none (the readings of conventionread.py and
    lineup.py; RoPE's tables of another form, runs/trace.py; a temperature, tuning.py).

    `steps`: the order the divergences are placed in, where the two references hold other steps (a temperature adds
    its own): there a step the order lacks is neither earlier nor later, and only the same step ranks, by its
    cause. `grade`: how a cause ranks at the same step (`explained` where not given; `named`: any cause named by
    experiment above none)."""
    grade = explained if grade is None else grade
    if other.divergence is None:
        return True
    mine, theirs = reached(other, steps), reached(first, steps)
    if mine is None or theirs is None:
        assert first.divergence is not None  # a line-up without one reaches every step
        return (other.divergence.reference == first.divergence.reference
                and grade(other.divergence.experiment) > grade(first.divergence.experiment))
    if first.divergence is None or mine != theirs:
        return mine > theirs
    return grade(other.divergence.experiment) > grade(first.divergence.experiment)


def explained(experiment: str | None) -> int:
    """How well a divergence is explained: no entry, two mistakes at once (pairs.py: "a+b"), one entry."""
    return 0 if experiment is None else 1 if "+" in experiment else 2


def named(experiment: str | None) -> int:
    """Whether a divergence is named by experiment at all, one entry or a pair alike."""
    return 0 if experiment is None else 1


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
    found = reached(lined)
    assert found is not None  # counted in its own steps, a step is always placed
    return found


def reached(lined: LineUp, steps: Sequence[str] | None = None) -> int | None:
    """Where the line-up's divergence stands in `steps` (its own rows' where not given): the number of steps before
    it, all of them and one more where there is none; a step `steps` lacks is None (0 in its own rows)."""
    names = [row.reference for row in lined.rows] if steps is None else list(steps)
    if lined.divergence is None:
        return len(names) + 1
    at = lined.divergence.reference
    if at in names:
        return names.index(at)
    return 0 if steps is None else None


def sized_over_solved(other: LineUp, first: LineUp) -> bool:
    """Whether `other` (under the code's own scale, DeBERTa's 1/√(3·d_head)) names at the same step a size in
    d_head's place (√(3·d_model): scale.d_model, scale.n) where `first` only solved a number (scale.other), whose
    advice (pass --scale) would hide the bug."""
    a, b = other.divergence, first.divergence
    return a is not None and b is not None and a.reference == b.reference and b.experiment == "scale.other" \
        and a.experiment is not None and a.experiment.startswith("scale.") and a.experiment != "scale.other"
