"""Everything the user sees: Rich tables, heatmaps, and the JSON export. The only module that imports rich.

Output reads the same with NO_COLOR=1 and when piped: colour is never the only carrier of meaning
(heatmaps use shade characters, PASS/FAIL are words).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from typing import IO, TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from attnscope.cost import format_bytes, format_flops

if TYPE_CHECKING:
    from attnscope.trace import Step, Trace

PIPED_WIDTH = 100  # Rich would fall back to 80 columns when piped; tables read better at 100


def console(stderr: bool = False) -> Console:
    stream: IO[str] = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() or "COLUMNS" in os.environ else PIPED_WIDTH
    return Console(file=stream, width=width, highlight=False, soft_wrap=False)


def steps_table(steps: Iterable[Step], title: str | None = None) -> Table:
    """One row per step, in order: its name, its named dims with their sizes and, under them, the op that
    made it; then dtype, size and FLOPs. Two lines a step keep the table readable in 100 columns."""
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False, collapse_padding=True)
    table.add_column("step", style="bold cyan", no_wrap=True)
    table.add_column("dims = shape  /  op", overflow="fold")
    table.add_column("dtype", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("FLOPs", justify="right", no_wrap=True)
    for step in steps:
        cell = Text(step.dims_text())
        cell.append("\n" + step.op, style="green")
        table.add_row(Text(step.name), cell, step.dtype,
                      format_bytes(step.nbytes) if step.allocates else "view",
                      short_flops(step.flops) if step.flops else "-")
    return table


def short_flops(n: int) -> str:
    """`328.5M`: a narrow column; the footer spells the unit out."""
    for unit, size in (("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


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
    out.print(Text(header, style="bold"))
    out.print(steps_table(trace.steps))
    for line in footer:
        out.print(Text(line))
    for note in trace.notes:
        out.print(Text(f"note: {note}", style="yellow"))


VALUES_LIMIT = 64  # elements: a preview, not a dump; bigger tensors show their corners


def show_values(out: Console, trace: Trace) -> None:
    from attnscope.tensors import preview

    for step in trace.steps:
        out.print(Text(f"{step.name} {list(step.shape)}", style="bold cyan"))
        out.print(Text(preview(step.tensor, VALUES_LIMIT)))


def emit_json(payload: dict[str, Any]) -> None:
    """One JSON object on stdout. The keys are a documented contract (docs/json.md): add, never rename."""
    sys.stdout.write(json.dumps(payload, indent=2, allow_nan=True) + "\n")


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


def error(message: str) -> None:
    """One line on stderr: what was wrong and how to fix it."""
    sys.stderr.write(f"attnscope: error: {' '.join(message.split())}\n")


def info(message: str) -> None:
    sys.stderr.write(f"attnscope: {message}\n")


# --- a run's result -----------------------------------------------------------------------------------

if TYPE_CHECKING:
    from attnscope.check import Comparison
    from attnscope.runs import Heatmap, RunResult


def cost_lines(result: RunResult) -> list[str]:
    return [
        f"total {format_flops(result.trace.total_flops)}   peak memory {format_bytes(result.peak_bytes)} traced "
        "(every step kept)",
        f"a fused F.scaled_dot_product_attention needs {format_bytes(result.fused_bytes)}: it never materializes "
        "scores or attention",
    ]


def show_result(out: Console, result: RunResult, *, values: bool = False, stats: bool = False) -> None:
    show_trace(out, result.header, result.trace, footer=cost_lines(result))
    if result.comparisons:
        out.print(check_table(result.comparisons))
    if result.heatmap:
        show_heatmap(out, result.heatmap)
    if stats:
        out.print(stats_table(result.trace))
    if values:
        show_values(out, result.trace)
    if result.saved:
        out.print(Text(f"saved {len(result.trace)} tensors to {result.saved}"))


def check_table(comparisons: Sequence[Comparison]) -> Table:
    table = Table(title="check against PyTorch", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for name in ("tensor", "reference", "max |diff|", "tolerance", "result"):
        table.add_column(name, justify="right" if "|" in name or name == "tolerance" else "left")
    for c in comparisons:
        verdict = Text("PASS", style="bold green") if c.passed else Text("FAIL", style="bold red")
        table.add_row(c.name, c.reference, f"{c.max_abs_diff:.2e}", f"{c.tolerance:.1e}", verdict)
    return table


def check_json(c: Comparison) -> dict[str, Any]:
    return {"name": c.name, "reference": c.reference, "max_abs_diff": _finite(c.max_abs_diff),
            "tolerance": c.tolerance, "passed": c.passed}


def result_json(result: RunResult, *, values: bool = False, stats: bool = False) -> dict[str, Any]:
    from attnscope.tensors import tensor_stats

    tensors = []
    for step in result.trace.steps:
        entry = step_json(step)
        if stats:
            entry["stats"] = _clean(tensor_stats(step.tensor))
        if values:
            small = step.tensor.device.type != "meta" and step.tensor.numel() <= VALUES_LIMIT
            entry["values"] = _clean(step.tensor.tolist()) if small else None
        tensors.append(entry)
    payload: dict[str, Any] = {
        "command": result.command,
        "params": result.params,
        "tensors": tensors,
        "totals": {"flops": result.trace.total_flops, "peak_bytes": result.peak_bytes,
                   "fused_peak_bytes": result.fused_bytes},
        "notes": list(result.trace.notes),
    }
    if result.comparisons:
        payload["check"] = [check_json(c) for c in result.comparisons]
        payload["check_passed"] = not result.check_failed
    if result.heatmap:
        payload["heatmap"] = heatmap_json(result.heatmap)
    if result.saved:
        payload["saved"] = str(result.saved)
    return payload


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None


def _clean(value: Any) -> Any:
    """JSON has no NaN or Infinity: they become null."""
    if isinstance(value, float):
        return _finite(value)
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


# --- heatmaps -----------------------------------------------------------------------------------------

SHADES = " ░▒▓█"  # five levels that read without colour (NO_COLOR, pipes)
HEATMAP_LIMIT = 64  # rows and columns drawn; larger patterns show their top-left corner


def heatmap_json(hm: Heatmap) -> dict[str, Any]:
    return {"title": hm.title, "rows": hm.row_labels, "cols": hm.col_labels, "matrix": hm.matrix}


def show_heatmap(out: Console, hm: Heatmap) -> None:
    """The pattern as shaded cells, rows = queries, columns = keys (labels read downwards), and for each
    row the key it attends to most and the row's entropy (0 = all on one key, ln n_K = uniform)."""
    import math

    n_rows, n_cols = len(hm.matrix), len(hm.matrix[0]) if hm.matrix else 0
    rows, cols = min(n_rows, HEATMAP_LIMIT), min(n_cols, HEATMAP_LIMIT)
    peak = max((max(r[:cols]) for r in hm.matrix[:rows]), default=0.0) or 1.0
    cell = 2 if cols <= 40 else 1
    row_w = min(max((len(s) for s in hm.row_labels[:rows]), default=1), 14)
    col_labels = [label[:10] for label in hm.col_labels[:cols]]

    out.print(Text(f"{hm.title}  [{n_rows} queries x {n_cols} keys]  (darker = more; max {peak:.3f})",
                   style="bold"))
    depth = max((len(s) for s in col_labels), default=0)
    for line in range(depth):  # column labels, written top to bottom
        chars = "".join((label[line] if line < len(label) else " ").ljust(cell) for label in col_labels)
        out.print(Text(" " * (row_w + 1) + chars.rstrip()))
    for i in range(rows):
        values = hm.matrix[i]
        text = Text(hm.row_labels[i][:row_w].rjust(row_w) + " ")
        for value in values[:cols]:
            level = min(len(SHADES) - 1, int(round(value / peak * (len(SHADES) - 1))))
            text.append(SHADES[level] * cell, style=_heat_style(value / peak))
        best = max(range(n_cols), key=values.__getitem__)
        entropy = max(0.0, -sum(p * math.log(p) for p in values if p > 0))
        text.append(f"  → {hm.col_labels[best][:12]} {values[best]:.2f}  H={entropy:.2f}")
        out.print(text)
    if rows < n_rows or cols < n_cols:
        out.print(Text(f"(showing the first {rows} x {cols}; --save or --json hold the whole pattern)"))


def _heat_style(fraction: float) -> str:
    # A blue-to-red ramp on top of the shade characters; without colour the characters alone carry it.
    red, blue = int(60 + 195 * fraction), int(200 - 160 * fraction)
    return f"rgb({red},60,{blue})"


# --- BERT ---------------------------------------------------------------------------------------------

if TYPE_CHECKING:
    from pathlib import Path

    from attnscope.bert import HeadWeights, SentenceRun

BERT_DIMS = {"W_Q": ("d_head", "d_model"), "W_K": ("d_head", "d_model"), "W_V": ("d_head", "d_model"),
             "b_Q": ("d_head",), "b_K": ("d_head",), "b_V": ("d_head",), "W_O": ("d_model", "d_head")}


def bert_summary(weights: HeadWeights) -> str:
    info = weights.info
    return (f"{info.architecture}: {info.n_layer} layers, {info.n_head} heads, d_model {info.d_model}, "
            f"d_head {info.d_head}   ·   layer {weights.layer}, head {weights.head}\n{info.folder}")


def head_table(weights: HeadWeights) -> Table:
    from attnscope.bert import describe, weight_stats

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("weight", style="bold cyan", no_wrap=True)
    table.add_column("dims = shape  /  from the checkpoint", overflow="fold")
    for name in ("mean", "std", "‖·‖_F"):
        table.add_column(name, justify="right", no_wrap=True)
    for name, tensor in weights.tensors.items():
        dims = BERT_DIMS[name]
        cell = Text(f"[{', '.join(dims)}] = {describe(tensor)[0]}")
        cell.append("\n" + weights.sources[name], style="green")
        stats = weight_stats(tensor)
        table.add_row(Text(name), cell, f"{stats['mean']:.4f}", f"{stats['std']:.4f}", f"{stats['norm']:.3f}")
    return table


def show_bert(out: Console, weights: HeadWeights, sentence: SentenceRun | None, saved: Path | None) -> None:
    from attnscope.runs import Heatmap

    out.print(Text(bert_summary(weights), style="bold"))
    out.print(head_table(weights))
    if sentence is not None:
        out.print(Text(f"this head on {len(sentence.tokens)} tokens", style="bold"))
        out.print(steps_table(sentence.trace.steps))
        for note in sentence.trace.notes:
            out.print(Text(f"note: {note}", style="yellow"))
        labels = list(sentence.tokens)
        show_heatmap(out, Heatmap(f"layer {weights.layer}, head {weights.head}: attention",
                                  sentence.trace["attention"].tolist(), labels, labels))
    if saved:
        count = len(weights.tensors) + (1 if sentence is not None else 0)
        out.print(Text(f"saved {count} tensors to {saved}"))


def bert_json(model: str, text: str | None, weights: HeadWeights, sentence: SentenceRun | None,
              saved: Path | None) -> dict[str, Any]:
    from attnscope.bert import describe, weight_stats

    info = weights.info
    tensors = []
    for name, tensor in weights.tensors.items():
        shape, dtype, nbytes = describe(tensor)
        tensors.append({"name": name, "shape": shape, "dims": list(BERT_DIMS[name]), "dtype": dtype,
                        "bytes": nbytes, "op": weights.sources[name],
                        "source": weights.sources[name], "stats": weight_stats(tensor)})
    payload: dict[str, Any] = {
        "command": "bert",
        "params": {"model": model, "layer": weights.layer, "head": weights.head, "text": text},
        "model": {"architecture": info.architecture, "path": str(info.folder), "layers": info.n_layer,
                  "heads": info.n_head, "d_model": info.d_model, "d_head": info.d_head},
        "tensors": tensors,
    }
    if sentence is not None:
        payload["tokens"] = sentence.tokens
        payload["attention"] = _clean(sentence.trace["attention"].tolist())
        payload["steps"] = [step_json(step) for step in sentence.trace.steps]
    if saved:
        payload["saved"] = str(saved)
    return payload


# --- bench --------------------------------------------------------------------------------------------

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnscope.bench import BenchResult


class progress_bar:  # noqa: N801 - used as a context manager, like rich's own
    """A Rich progress bar on stderr; yields `tick(label)` that advances it by one run."""

    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        err = console(stderr=True)
        # Drawn only on a terminal: piped, a live bar would leave blank lines in the log.
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=err, transient=True, disable=not err.is_terminal)
        self.task = self.progress.add_task("timing", total=total)

    def __enter__(self) -> Callable[[str], None]:
        self.progress.__enter__()
        return self.tick

    def tick(self, label: str) -> None:
        self.progress.update(self.task, advance=1, description=f"timing {label}")

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)  # type: ignore[arg-type]


def show_bench(out: Console, result: BenchResult) -> None:
    p = result.params
    sizes = "  ".join(f"{k}={v}" for k, v in p.items() if k not in ("runs", "warmup", "device", "dtype"))
    out.print(Text(f"bench {result.command}  {sizes}\n{p['device']}, {p['dtype']}, median of {p['runs']} runs "
                   f"after {p['warmup']} warm-up; {format_flops(result.flops)} per call", style="bold"))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for name, justify in (("contender", "left"), ("median ms", "right"), ("GFLOP/s", "right"),
                          ("peak memory", "right"), ("vs first", "right"), ("max |diff|", "right")):
        table.add_column(name, justify=justify, no_wrap=name != "contender")  # type: ignore[arg-type]
    first = result.contenders[0].median_ms
    for c in result.contenders:
        table.add_row(c.name, f"{c.median_ms:.3f}", f"{c.gflops_per_s:.1f}",
                      _peak_text(c.peak_bytes),
                      f"{c.median_ms / first:.2f}x", f"{c.max_abs_diff:.1e}")
    out.print(table)
    out.print(Text(f"peak memory: {result.memory_method}"))
    if result.backends:
        backends = Table(title="SDPA backends on CUDA for these inputs", box=box.SIMPLE_HEAD, title_justify="left",
                         pad_edge=False)
        backends.add_column("backend", no_wrap=True)
        backends.add_column("eligible", no_wrap=True)
        backends.add_column("why not", overflow="fold")
        for b in result.backends:
            backends.add_row(b.name, "yes" if b.eligible else "no", Text(b.why_not))
        out.print(backends)


def _peak_text(peak: int | None) -> str:
    if peak is None:
        return "n/a"
    # malloc serves blocks under its mmap threshold from memory the process already holds
    return format_bytes(peak) if peak else "< 128 KiB"


def bench_json(result: BenchResult) -> dict[str, Any]:
    return {
        "command": f"bench {result.command}",
        "params": result.params,
        "flops": result.flops,
        "contenders": [{"name": c.name, "median_ms": c.median_ms, "gflops_per_s": c.gflops_per_s,
                        "peak_bytes": c.peak_bytes, "max_abs_diff": _finite(c.max_abs_diff)}
                       for c in result.contenders],
        "memory_method": result.memory_method,
        "backends": [{"name": b.name, "eligible": b.eligible, "why_not": b.why_not} for b in result.backends],
    }
