"""What a run is doing, on stderr while it works: a spinner with the run's own words, and where the run counts
(every layer, decoding, a long input's layers) how far it is: `running all 30 layers on 1,228 tokens: layer 12
of 30`. Shown only where stderr is a terminal; on a pipe (and under --json, whose stdout it never touches)
nothing is written.

A run reports through `runs.head_result.Progress`: `progress(message, total=n, unit="layer")` is a context
manager giving `tick(index)`, called as item `index` (from 0) starts; rich's `Console.status` draws it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console

Tick = Callable[[int], None]


def counting(index: int, total: int, unit: str) -> str:
    """`layer 12 of 30`: the item that runs now (from 1) out of the total."""
    return f"{unit} {min(index + 1, total):,} of {total:,}"


class Spinner:
    """`progress` for a run on a terminal: each message a spinner on `console` (stderr), counting where the run
    gives a total; a console that is not a terminal gets nothing."""

    def __init__(self, console: Console) -> None:
        self.console = console

    @contextmanager
    def __call__(self, message: str, total: int | None = None, unit: str = "layer") -> Iterator[Tick]:
        if not self.console.is_terminal:
            yield _ignore
            return
        with self.console.status(message) as status:

            def tick(index: int) -> None:
                if total:
                    status.update(f"{message}: {counting(index, total, unit)}")

            yield tick


def _ignore(index: int) -> None:
    pass
