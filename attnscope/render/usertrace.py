"""`attnscope trace`: the user's steps, the alignment with the reference, the first divergence; and its JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from attnscope.render.console import finite
from attnscope.render.tables import step_json, steps_table
from attnscope.words import counted

if TYPE_CHECKING:
    from attnscope.runs.trace import TraceRun
    from attnscope.usertrace.lined import Aligned

STATUS_STYLE = {"equal": "green", "permuted": "green", "unseen": "yellow", "differs": "bold red",
                "missing": "bold red"}


def show_usertrace(out: Console, run: TraceRun) -> None:
    for i, line in enumerate(run.header):
        out.print(Text(line, style="bold" if i == 0 else ""))
    out.print(steps_table(run.steps, title="your code, op by op"))
    for note in run.notes:
        out.print(Text(f"note: {note}", style="yellow"))
    if run.failure is not None:
        show_failure(out, run)
        return
    if run.no_reference:
        return
    out.print(Text(f"\nreference: {run.reference}"))
    if run.saved:
        out.print(Text(f"saved the line-up, step by step, to {run.saved}"))
    out.print(alignment_table(run.alignment))
    if run.divergence is None:
        out.print(Text("every reference step has its equal in your code: it computes what the reference computes",
                       style="bold green"))
        return
    d = run.divergence
    where = f" at your {d.record.label} (line {d.record.line})" if d.record is not None else ""
    out.print(Text(f"first divergence: {d.reference}{where}", style="bold red"))
    out.print(Padding(Text(d.diagnosis), (0, 0, 0, 2)))
    if d.evidence:
        out.print(Padding(Text(d.evidence, style="dim"), (0, 0, 0, 2)))


def alignment_table(rows: list[Aligned]) -> Table:
    table = Table(title="line-up with the reference", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False,
                  collapse_padding=True)
    table.add_column("reference", style="bold cyan", no_wrap=True)
    table.add_column("yours", overflow="fold")
    table.add_column("line", justify="right", no_wrap=True)
    table.add_column("shape", no_wrap=True)
    table.add_column("max |diff|", justify="right", no_wrap=True)
    table.add_column("status", overflow="fold")
    first = True
    for row in rows:
        status = Text(row.status, style=STATUS_STYLE.get(row.status, ""))
        if row.status in ("differs", "missing") and first:
            status = Text("DIVERGES", style="bold red")
            first = False
        if row.layout and row.status != "differs":
            status.append(f"\n{row.layout}", style="dim")
        record = row.record
        table.add_row(row.reference, record.label if record else "-", str(record.line) if record else "",
                      str(list(record.tensor.shape)) if record else str(row.shape),
                      f"{row.max_abs_diff:.1e}" if row.max_abs_diff is not None else "-", status)
    return table


def show_failure(out: Console, run: TraceRun) -> None:
    f = run.failure
    assert f is not None
    where = f"line {f.line}" if f.line else "your code"
    out.print(Text(f"\nyour code failed at {where}: {f.message}", style="bold red"))
    lines = []
    if f.op:
        lines.append(f"op: {f.op}")
        if f.shapes:
            lines.append(f"shapes that met: {' and '.join(str(s) for s in f.shapes)}")
    if run.failure_source:
        lines.append(run.failure_source)
    ran = counted(len([s for s in run.steps if s.line is not None]), "op")
    lines.append(f"the {ran} above ran before it")
    for line in lines:
        out.print(Padding(Text(line), (0, 0, 0, 2)))


def usertrace_json(run: TraceRun) -> dict[str, Any]:
    steps = []
    for step in run.steps:
        entry = step_json(step)
        entry["line"] = step.line
        entry["recomputed"] = step.recomputed
        steps.append(entry)
    payload: dict[str, Any] = {
        "command": "trace",
        "params": run.params,
        "steps": steps,
        "reference": run.reference or None,
        "alignment": [_aligned_json(row) for row in run.alignment],
        "first_divergence": None,
        "notes": list(run.notes),
        "error": None,
        "saved": str(run.saved) if run.saved else None,
    }
    if run.divergence is not None:
        d = run.divergence
        payload["first_divergence"] = {
            "reference": d.reference, "user": d.record.label if d.record else None,
            "line": d.record.line if d.record else None,
            "ratio": finite(d.ratio) if d.ratio is not None else None,
            "diagnosis": f"{d.diagnosis}; {d.evidence}" if d.evidence else d.diagnosis,
            "experiment": d.experiment, "evidence": d.evidence}
    if run.failure is not None:
        f = run.failure
        payload["error"] = {"kind": "exception", "op": f.op or None, "line": f.line, "shapes": f.shapes,
                            "message": f.message, "source": run.failure_source}
    elif run.no_reference:
        payload["error"] = {"kind": "no_reference", "message": run.no_reference}
    return payload


def _aligned_json(row: Aligned) -> dict[str, Any]:
    record = row.record
    return {"reference": row.reference, "user": record.label if record else None,
            "line": record.line if record else None,
            "max_abs_diff": finite(row.max_abs_diff) if row.max_abs_diff is not None else None,
            "status": row.status, "shape": row.shape, "dims": list(row.dims),
            "user_shape": list(record.tensor.shape) if record else None, "layout": row.layout or None,
            "recomputed": bool(record is not None and "recomputed" in record.details)}
