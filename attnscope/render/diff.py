"""`attnscope diff`: the two runs step by step, what only one holds, the first divergence and why; and its JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.padding import Padding
from rich.text import Text

from attnscope.render.console import finite
from attnscope.render.fit import Column, FittedTable, broken, cell, whole

if TYPE_CHECKING:
    from rich.console import Console

    from attnscope.runs.diff import DiffRow, DiffRun

STYLE = {"agrees": "green", "differs": "bold red", "shape": "bold red"}


def show_diff(out: Console, run: DiffRun) -> None:
    out.print(Text(f"diff {run.a} (A) {run.b} (B)", style="bold"))
    columns = [Column("step", style="bold cyan"), Column("dims = shape"), Column("dtype", drop=2),
               Column("max |diff|", justify="right"), Column("tolerance", justify="right", drop=1), Column("status")]
    rows = []
    first = True
    for row in run.rows:
        status = row.status
        if row.status != "agrees" and first:
            status, first = "DIVERGES", False
        rows.append([cell(whole(row.name or "(tensor)")), cell(broken(_shape(row))), cell(broken(_dtype(row))),
                     cell(whole(_number(row.max_abs_diff))), cell(whole(_number(row.tolerance))),
                     cell(whole(status, STYLE.get(row.status)))])
    out.print(FittedTable(columns, rows, shrink=[1], title="steps both runs hold, in A's order"))
    for side, names in (("A", run.only_a), ("B", run.only_b)):
        if names:
            out.print(Text(f"only in {side}: {', '.join(n or '(tensor)' for n in names)}", style="yellow"))
    for note in run.notes:
        out.print(Text(f"note: {note}", style="yellow"))
    if run.first is None:
        out.print(Text(f"every step both runs hold agrees within its tolerance ({len(run.rows)} compared)",
                       style="bold green"))
        return
    out.print(Text(f"first divergence: {run.first or '(tensor)'}", style="bold red"))
    if run.diagnosis:
        out.print(Padding(Text(run.diagnosis), (0, 0, 0, 2)))


def _shape(row: DiffRow) -> str:
    shape = str(row.shape_a) if row.shape_a == row.shape_b else f"{row.shape_a} in A, {row.shape_b} in B"
    return f"[{', '.join(row.dims)}] = {shape}" if row.dims else shape


def _dtype(row: DiffRow) -> str:
    return row.dtype_a if row.dtype_a == row.dtype_b else f"{row.dtype_a} in A, {row.dtype_b} in B"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def diff_json(run: DiffRun) -> dict[str, Any]:
    return {
        "command": "diff",
        "params": dict(run.params),
        "steps": [_row_json(row) for row in run.rows],
        "only_a": list(run.only_a),
        "only_b": list(run.only_b),
        "first_divergence": None if run.first is None else {"name": run.first, "diagnosis": run.diagnosis},
        "notes": list(run.notes),
    }


def _row_json(row: DiffRow) -> dict[str, Any]:
    return {"name": row.name, "dims": row.dims, "shape_a": row.shape_a, "shape_b": row.shape_b,
            "dtype_a": row.dtype_a, "dtype_b": row.dtype_b,
            "max_abs_diff": finite(row.max_abs_diff) if row.max_abs_diff is not None else None,
            "tolerance": finite(row.tolerance) if row.tolerance is not None else None,
            "status": row.status, "detail": row.detail or None}
