"""What the commands share: reading --max-memory, the --svg/--html exports around a command's output, and
showing an sdpa/mha run (table or JSON, exit 1 on FAIL)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from attnscope.runs.outputs import RunResult


def max_memory_bytes(text: str | None) -> int | None:
    from attnscope.cost import parse_size
    from attnscope.errors import UsageError

    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise UsageError(f"--max-memory: {exc}") from None


class Page:
    """What --html writes for a command that shows attention (sdpa, mha, head, bert, trace): the explorer page
    of its result (attnscope/views/explorer.py), built only when --html asks for it. The command hands over
    its result once it has one (`of`); mask and bench hand none, and --html keeps the terminal's record."""

    def __init__(self) -> None:
        self.build: Callable[[], str] | None = None
        self.svg: Callable[[], str | None] | None = None  # a picture --svg writes instead of the record (--image)

    def of(self, result: Any, builder: Callable[[Any], Any]) -> None:
        """`builder` (views/sources.py) makes the page's data from `result`."""
        from attnscope.views.explorer import page_html

        self.build = lambda: page_html(builder(result))


@contextmanager
def exporting(svg: str | None, html: str | None, *, force: bool, json: bool, title: str,
              page: Page | None = None) -> Iterator[Console]:
    """Every command's output goes through here: on entering, --svg/--html are checked (before the run, so a
    name that cannot be written costs nothing); the block prints to the console it is given; once the output
    is complete (the block ends, or exits 1 after showing it: a FAIL, a divergence) the files are written.
    With `page`, --html is the explorer page of the result the block handed to it, not the terminal's record.
    A failure inside the block writes nothing. Use inside `reported(...)`, which reports what is raised here."""
    from attnscope.render import export

    exports = export.Exports(svg, html, force, title)
    export.check(exports, json)
    out = export.output_console(exports)
    try:
        yield out
    except typer.Exit as exc:
        if exc.exit_code == 1 and exports:
            _write(out, exports, page)
        raise
    if exports:
        _write(out, exports, page)


def _write(out: Console, exports: object, page: Page | None) -> None:
    from attnscope import render
    from attnscope.render import export

    assert isinstance(exports, export.Exports)
    html = page.build() if page is not None and page.build is not None and exports.html else None
    svg = page.svg() if page is not None and page.svg is not None and exports.svg else None
    written = export.write(out, exports, html=html, svg=svg)
    render.info(f"wrote {' and '.join(str(path) for path in written)}")


def show_run(out: Console, result: RunResult, *, json: bool, values: bool, stats: bool,
             page: Page | None = None) -> None:
    from attnscope import render

    if page is not None:
        from attnscope.readings.headstats import describe
        from attnscope.views.sources import from_run

        page.of(result, lambda run: from_run(run, describe))
    if json:
        render.emit_json(render.result_json(result, values=values, stats=stats))
    else:
        render.show_result(out, result, values=values, stats=stats)
    if result.check_failed:
        raise typer.Exit(1)
