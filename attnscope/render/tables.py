"""Tables of steps, statistics and checks: the rows every command shares."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from attnscope.cost import format_bytes, scale_count
from attnscope.render.console import finite
from attnscope.render.fit import Column, FittedTable, FittedText, broken, cell, whole

if TYPE_CHECKING:
    from attnscope.check.comparison import Comparison
    from attnscope.trace import Step, Trace


def steps_table(steps: Iterable[Step], title: str | None = None) -> FittedTable:
    """One row per step, in order: its name, its named dims with their sizes and, under them, the op that
    made it; then dtype, size and FLOPs. Fitted to the terminal: `dims = shape` and the op break only
    between tokens (shape under dims, a chained call under its receiver); when that is not enough, dtype,
    then FLOPs, then size are left out, and the table says so."""
    columns = [Column("step", style="bold cyan"), Column("dims = shape  /  op"), Column("dtype", drop=1),
               Column("size", justify="right", drop=3), Column("FLOPs", justify="right", drop=2)]
    rows = [[cell(whole(step.name)), cell(broken(step.dims_text()), broken(step.op, "green")), cell(whole(step.dtype)),
             cell(whole(format_bytes(step.nbytes) if step.allocates else
                        "-" if getattr(step, "recomputed", False) else "view")),
             cell(whole(short_flops(step.flops) if step.flops else "-"))] for step in steps]
    return FittedTable(columns, rows, shrink=[1], title=title)


def short_flops(n: int) -> str:
    """`328.5M`: a narrow column; the footer spells the unit out."""
    prefix, size = scale_count(n)
    return f"{size:.1f}{prefix}" if prefix else str(n)


def stats_table(trace: Trace) -> Table:
    """min, max, mean, std and NaN/Inf counts of every step (the user's first stop when numbers look wrong)."""
    from attnscope.tensors import tensor_stats

    table = Table(title="statistics", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for name in ("step", "min", "max", "mean", "std", "NaN", "Inf"):
        table.add_column(name, justify="left" if name == "step" else "right", no_wrap=True)
    for step in trace.steps:
        s = tensor_stats(step.tensor)
        if s is None:
            table.add_row(step.name, *["-"] * 6)
            continue
        table.add_row(step.name, f"{s['min']:.4g}", f"{s['max']:.4g}", f"{s['mean']:.4g}", f"{s['std']:.4g}",
                      str(s["nan"]), str(s["inf"]))
    return table


def show_trace(out: Console, header: str, trace: Trace, footer: Sequence[str] = ()) -> None:
    out.print(FittedText(header, style="bold"))
    out.print(steps_table(trace.steps))
    for line in footer:
        out.print(FittedText(line))
    for note in trace.notes:
        out.print(FittedText(f"note: {note}", style="yellow"))


VALUES_LIMIT = 64  # elements: a preview, not a dump; bigger tensors show their corners


def show_values(out: Console, trace: Trace) -> None:
    for step in trace.steps:
        out.print(Text(f"{step.name} {list(step.shape)}", style="bold cyan"))
        out.print(Text(balanced_preview(step.tensor, out.width)))  # a row wrapped by Rich split a number


def balanced_preview(tensor: Any, width: int) -> str:
    """`preview` at the narrowest line width that takes no more lines than `width` does: a row too long for one
    line is split evenly (8 values as 4 + 4), never as 7 with the last value on a line of its own."""
    from attnscope.tensors import preview

    def lines(at: int) -> int:
        return preview(tensor, VALUES_LIMIT, width=at).count("\n")

    fewest = lines(width)
    low, high = min(20, width), width  # lines(high) == fewest; the count only grows as the width shrinks
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if lines(middle) <= fewest else (middle + 1, high)
    return preview(tensor, VALUES_LIMIT, width=high)


def step_json(step: Step) -> dict[str, Any]:
    return {
        "name": step.name,
        "shape": list(step.shape),
        "dims": list(step.dims),
        "dtype": step.dtype,
        "bytes": step.nbytes,
        "allocates": step.allocates,
        "flops": step.flops,
        "op": step.op,
    }


def check_table(comparisons: Sequence[Comparison], against: str = "PyTorch") -> Table:
    table = Table(title=f"check against {against}", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for name in ("tensor", "reference", "max |diff|", "tolerance", "result"):
        table.add_column(name, justify="right" if "|" in name or name == "tolerance" else "left")
    for c in comparisons:
        verdict = Text("PASS", style="bold green") if c.passed else Text("FAIL", style="bold red")
        table.add_row(c.name, c.reference, f"{c.max_abs_diff:.2e}", f"{c.tolerance:.1e}", verdict)
    return table


def check_json(c: Comparison) -> dict[str, Any]:
    return {"name": c.name, "reference": c.reference, "max_abs_diff": finite(c.max_abs_diff),
            "tolerance": c.tolerance, "passed": c.passed, "detail": c.detail}
