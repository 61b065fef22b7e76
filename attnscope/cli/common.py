"""What the attention commands share: reading --max-memory, and showing a run (table or JSON, exit 1 on FAIL)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from attnscope.runs.common import RunResult


def max_memory_bytes(text: str | None) -> int | None:
    from attnscope.cost import parse_size
    from attnscope.errors import UsageError

    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise UsageError(f"--max-memory: {exc}") from None


def show_run(result: RunResult, *, json: bool, values: bool, stats: bool) -> None:
    from attnscope import render

    if json:
        render.emit_json(render.result_json(result, values=values, stats=stats))
    else:
        render.show_result(render.console(), result, values=values, stats=stats)
    if result.check_failed:
        raise typer.Exit(1)
