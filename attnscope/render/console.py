"""The console, one-line errors and JSON output: what every other render module builds on."""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Any

from rich.console import Console

PIPED_WIDTH = 100  # Rich would fall back to 80 columns when piped; tables read better at 100


def console(stderr: bool = False, record: bool = False, no_color: bool | None = None) -> Console:
    """stdout's console (stderr's with `stderr`); `record` keeps what is printed, for --svg/--html."""
    stream: IO[str] = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() or "COLUMNS" in os.environ else PIPED_WIDTH
    return Console(file=stream, width=width, highlight=False, soft_wrap=False, record=record, no_color=no_color)


def emit_json(payload: dict[str, Any]) -> None:
    """One JSON object on stdout. The keys are a documented contract (docs/json.md): add, never rename.
    JSON has no NaN or Infinity: the whole payload is cleaned (they become null), whatever key holds them,
    and dumped with allow_nan=False, so none can ever slip through."""
    sys.stdout.write(json.dumps(clean(payload), indent=2, allow_nan=False) + "\n")


def error(message: str) -> None:
    """One line on stderr: what was wrong and how to fix it."""
    sys.stderr.write(f"attnscope: error: {' '.join(message.split())}\n")


def info(message: str) -> None:
    sys.stderr.write(f"attnscope: {message}\n")


def finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None


def clean(value: Any) -> Any:
    """JSON has no NaN or Infinity: they become null, in lists, tuples and dicts at any depth."""
    if isinstance(value, float):
        return finite(value)
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    return value
