"""What a catalog entry is (Experiment: a name, a group, a mistake in words, its trials), one run of it (Trial),
the runs made on a base, each once (runs), and the steps each group of mistakes changes first."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from attnscope.usertrace.rerun import Base, Reproduced, watching

SAYS_RERUN = "the reference run again with this mistake gives back {gives} to tolerance"


@dataclass
class Trial:
    """One run of an entry: the replayed steps, the words (`{who}`: the user's tensor that shows it), the ratio
    of a scale, and what the user's own op must be for these words (None: any)."""

    steps: dict[str, torch.Tensor]
    words: str
    ratio: float | None = None
    fits: Callable[[Base, Reproduced], bool] | None = None
    tol: str = ""
    detail: str = ""  # what the rerun changed, where the words name the mistake otherwise (a scale's ratio)
    # the words led by the reference step where the code diverged ("K_split": the keys' split named first, where the
    # mistake is made in several roles alike); None: `words` wherever it diverged
    lead: Callable[[str], str] | None = None

    def said(self, step: str | None) -> str:
        """The words, led by the diverged `step` where they can be."""
        return self.lead(step) if self.lead is not None and step is not None else self.words


@dataclass(frozen=True)
class Experiment:
    name: str  # stable, in --json's first_divergence.experiment: "scale.d_model"
    group: str
    mistake: str  # one line for the docs
    trials: Callable[[Base], Iterator[Trial]] = field(compare=False)

    def can_change(self, b: Base, step: str) -> bool:
        """Whether the mistake can change `step`: it is not before the first step the mistake's group changes."""
        starts = JOINED_FIRST.get(self.group, ()) if b.raw_keys is not None else ()
        first = [b.order.index(n) for n in (*FIRST.get(self.group, ()), *starts) if n in b.order]
        return not first or b.order.index(step) >= min(first)


@dataclass(frozen=True)
class Run:
    """One trial of a catalog entry as made on a base, with the changes replay was given for its steps
    (rerun.watching): empty where its steps are no one replay's as it returned them (a run rejoined or edited after
    it), which no pair of mistakes can join (pairs.by_pair)."""

    experiment: Experiment
    trial: Trial
    change: dict[str, Any]


def runs(experiment: Experiment, b: Base) -> list[Run]:
    """The entry's trials on `b`, made the first time they are asked for and kept (Base.runs): by_experiment asks at
    each step it tries, and pairs of mistakes join the runs it made. A trial that does not apply to these shapes (a
    view that cannot be made: RuntimeError) ends the entry's runs."""
    kept = b.runs.get(experiment.name)
    if kept is not None:
        return kept
    made: list[Run] = []
    with watching() as seen:
        try:
            for trial in experiment.trials(b):
                change = next((change for steps, change in reversed(seen) if steps is trial.steps), None)
                made.append(Run(experiment, trial, change or {}))
        except RuntimeError:
            pass
    b.runs[experiment.name] = made
    return made


# The steps a group's mistakes change first (the earliest the reference holds); one before them they leave alone.
# (the scale's: the queries too, scaled before a kernel that scales again)
FIRST = {"scale": ("scores", "Q_feat", "Q_split", "Q_rot", "Q"),
         "softcap": ("scores", "capped_scores", "biased_scores", "masked_scores", "attention"),
         "softmax": ("attention",), "mask": ("masked_scores",),
         "keys and values": ("K_feat", "V_feat", "K_rot", "K_split", "K", "V_split", "V", "scores"),
         "cache": ("K_cat", "V_cat"),
         "grouped-query": ("K_rep", "V_rep", "scores"),
         "query heads": ("Q_split", "Q_normed", "Q_rot", "Q", "scores"),
         "RoPE": ("Q_split", "K_split", "Q_rot", "K_rot", "scores"),
         "ALiBi": ("biased_scores",), "T5 bias": ("biased_scores",), "precision": ("scores",),
         "dropout": ("attention",), "pattern": ("scores", "attention"),
         "qk-norm": ("Q_normed", "K_normed", "Q_split", "K_split", "Q_rot", "K_rot", "V_split", "scores"),
         "heads": ("Q_split", "K_split", "V_split", "x_rsh2", "Q_feat", "K_feat", "V_feat")}


# (a fused projection's heads split wrongly: the first tensor of the code's that holds Q_feat apart is the split one,
# usertrace/fusedsplit.py)
# Where the code joins its cache before RoPE (rerun.Base.raw_keys), the join's mistakes change the rotated keys too
JOINED_FIRST = {"cache": ("K_rot",)}
