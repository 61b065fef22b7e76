"""Two deviations at once, named by experiment: where no one entry of the catalog reproduces the code's tensors,
the reference is run again with the changes of two entries joined (usertrace/rerun.replay given both), and the pair
names the cause only where that run gives the code's own tensors back to tolerance (rerun.reproduces).

The pairs are bounded, so the cost is a handful of reruns, not the catalog squared: the first of a pair is one of
the three entries whose run moves the reference closest to the code at the diverging step (more of its cells equal
the code's there than the reference's do); the second is any other entry whose changes touch other arguments of the
replay, and that either moves the reference closer at that step too or first changes another step.

A pair is said in one of three ways. Where one of the two is an entry for what the code does and trace was not told
of (rope.untold: no mistake of the code's), `experiment` is the other's name, the untold one said first. Where
one of the two runs alone leaves the reference's output as it is (ALiBi's
bias made symmetric, −m_h · |i − j|, under a causal mask that hides every key after the query), that one is a
convention of the code, kept, and the other names the cause (`experiment` is its name). Where both change the
output, both are mistakes, and `experiment` is their two names joined by "+", in the catalog's order
("alibi.sign+mask.off_by_one").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnscope.usertrace.align import VERY_NEGATIVE, difference, tolerance
from attnscope.usertrace.diagnosis import Diagnosis, label_of

if TYPE_CHECKING:
    from attnscope.usertrace.rerun import Base, Reproduced
    from attnscope.usertrace.trials import Run

FIRSTS = 3  # the entries a pair may start from: those that move the reference closest to the code


def by_pair(step: str, base: Base) -> Diagnosis | None:
    """The pair of the catalog's entries whose joined run reproduces the code's tensors (module doc), or None."""
    from attnscope.usertrace.align import candidates
    from attnscope.usertrace.experiments import CATALOG
    from attnscope.usertrace.rerun import replay, reproduces
    from attnscope.usertrace.trials import runs

    if base.col or step not in base.ref:
        return None
    reference = base.ref[step]
    tol = _tol(reference)
    # the code's tensors of the step's shape, in any layout (the one after a bias of its own, or before it)
    users = [m.layout.undo(m.record.tensor, tuple(reference.shape)).double()
             for m in candidates(base.ctx.records, base.ctx.reference[step], step, base.ctx.skip.get(step))]
    if not users:
        return None

    def agree(tensor: torch.Tensor, user: torch.Tensor) -> int:
        """How many of the step's cells equal the code's: the same number, both masked, or the same infinity (a
        float16 product past 65504)."""
        if tuple(tensor.shape) != tuple(user.shape):
            return -1
        both = (tensor <= VERY_NEGATIVE) & (user <= VERY_NEGATIVE) | torch.isinf(tensor) & (tensor == user)
        same = torch.isfinite(tensor) & torch.isfinite(user) & ((tensor - user).abs() <= tol)
        return int((both | same).sum())

    start = [agree(reference, user) for user in users]

    def gain(t: Run) -> int:
        """How many more cells of one of the code's tensors the entry's run gets right than the reference does."""
        at = t.trial.steps.get(step)
        return max(agree(at, user) - before for user, before in zip(users, start, strict=True)) if at is not None \
            else -1

    # every entry's runs: by_experiment's, and now those of the entries that could not change the step alone
    made = [run for experiment in CATALOG for run in runs(experiment, base) if run.change]
    gains = [gain(t) for t in made]
    starts = [_first_changed(base, t) for t in made]
    firsts: list[int] = []
    for i in sorted(range(len(made)), key=lambda i: -gains[i]):
        if gains[i] > 0 and all(made[f].experiment != made[i].experiment for f in firsts) and len(firsts) < FIRSTS:
            firsts.append(i)
    best: tuple[tuple[int, int], Reproduced, Run, Run] | None = None
    for f in firsts:
        first = made[f]
        for i, second in enumerate(made):
            if second.experiment == first.experiment or set(second.change) & set(first.change):
                continue
            if gains[i] <= 0 and starts[i] == starts[f]:  # it moves nothing closer, and changes the same step first
                continue
            try:
                steps = replay(base, **first.change, **second.change)
            except RuntimeError:
                continue
            said = first.trial.tol or second.trial.tol  # "float16" where either run is
            found = reproduces(base, step, steps, said)
            if found is None or not all(_fits(base, t, steps, said) for t in (first, second)):
                continue
            # a convention of the code's and one mistake before two mistakes; then the run the code holds most of
            rank = (-sum(not _neutral(base, t) for t in (first, second)), found.held)
            if best is None or rank > best[0]:
                best = (rank, found, first, second)
    return _said(base, *best[1:]) if best is not None else None


def _tol(tensor: torch.Tensor) -> float:
    """A reference step's tolerance: float32's, as the reruns compare it (rerun.reproduces)."""
    return tolerance(tensor, torch.float32)


def _fits(base: Base, run: Run, steps: dict[str, torch.Tensor], tol: str) -> bool:
    """Whether the code's own op fits the entry's words (Trial.fits), asked of the code's tensor that holds the
    first step this entry changes in the joined run (the mask's, not the scale's before it)."""
    from attnscope.usertrace.rerun import reproduces

    if run.trial.fits is None:
        return True
    found = reproduces(base, _first_changed(base, run) or base.last, steps, tol, strict=False)
    return found is not None and run.trial.fits(base, found)


def _who(base: Base, run: Run, found: Reproduced) -> str | None:
    """The code's tensor that holds the first step this entry changes in the joined run, in words."""
    from attnscope.usertrace.rerun import reproduces

    at = reproduces(base, _first_changed(base, run) or base.last, found.steps, run.trial.tol, strict=False)
    return label_of(at.record) if at is not None and at.record is not None else None


def _first_changed(base: Base, run: Run) -> str | None:
    steps = run.trial.steps
    return next((n for n in base.order if n in steps and n in base.ref and tuple(steps[n].shape) ==
                 tuple(base.ref[n].shape) and difference(steps[n], base.ref[n]) > _tol(base.ref[n])), None)


def _neutral(base: Base, run: Run) -> bool:
    """Whether the entry's run alone leaves the reference's output as it is: a convention of the code's, no
    mistake, where the reference's other rules hide what it changes."""
    last = run.trial.steps.get(base.last)
    reference = base.ref[base.last]
    return last is not None and tuple(last.shape) == tuple(reference.shape) and \
        difference(last, reference) <= _tol(reference)


def _said(base: Base, found: Reproduced, first: Run, second: Run) -> Diagnosis:
    from attnscope.usertrace.experiments import CATALOG
    from attnscope.usertrace.trials import SAYS_RERUN

    pair = sorted((first, second), key=lambda t: CATALOG.index(t.experiment))
    who = label_of(found.record) if found.record is not None else label_of(found.final)
    gives = label_of(found.final) if found.record is None or found.final is found.record else (
        f"{who} and {label_of(found.final)}")
    untold = [t for t in pair if t.experiment.name.endswith(".untold") or t.experiment.name.endswith("_untold")]
    if len(untold) == 1:  # what the code does and trace was not told of (--rope), and one mistake
        told, cause = untold[0], pair[1] if untold[0] is pair[0] else pair[0]
        text = (f"{told.trial.words.format(who=_who(base, told, found) or who)}; and with it described, "
                f"{cause.trial.words.format(who=_who(base, cause, found) or who)}")
        evidence = (f"by experiment: {cause.experiment.name} with {told.experiment.name} (no mistake of your code's: "
                    f"trace was not told of it); {SAYS_RERUN.format(gives=gives)}")
        return Diagnosis(text, found.record, cause.trial.ratio, cause.experiment.name, evidence)
    neutral = [t for t in pair if _neutral(base, t)]
    if len(neutral) == 1:  # a convention of the code's and one mistake
        kept = neutral[0]
        cause = pair[1] if kept is pair[0] else pair[0]
        text = (f"{cause.trial.words.format(who=who)} (the reference run with your code's own convention too: "
                f"{kept.experiment.mistake}, which alone leaves the output as the reference's)")
        evidence = (f"by experiment: {cause.experiment.name} with your code's {kept.experiment.name} kept; "
                    f"{SAYS_RERUN.format(gives=gives)}")
        return Diagnosis(text, found.record, cause.trial.ratio, cause.experiment.name, evidence)
    said = [t.trial.words.format(who=_who(base, t, found) or who) for t in pair]
    text = f"two mistakes at once: {said[0]}; and {said[1]}; neither alone gives your tensors back"
    name = "+".join(t.experiment.name for t in pair)
    evidence = f"by experiment: the two mistakes joined ({name}); " + SAYS_RERUN.format(gives=gives).replace(
        "this mistake", "these two mistakes")
    return Diagnosis(text, found.record, pair[0].trial.ratio or pair[1].trial.ratio, name, evidence)
