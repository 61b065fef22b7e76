"""`attnscope bench`: the progress bar, the contenders' table, the CUDA backends; and the JSON."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from attnscope.cost import format_bytes, format_flops
from attnscope.render.console import console, finite
from attnscope.render.fit import Column, FittedTable, FittedText, broken, cell, whole
from attnscope.words import counted

if TYPE_CHECKING:
    from attnscope.runs.race import BenchResult, Contender, Race


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


SIZE_NAMES = {"batch": "n_batch", "nq": "n_Q", "nk": "n_K", "dk": "d_K", "dv": "d_V", "d_feat": "d_feat",
              "heads": "n_head"}


def bench_header(command: str, params: dict[str, Any]) -> str:
    """`bench mha  n_batch=4  n_Q=256 ... bias  causal=upper-left`: the sizes by their dim names, and only the
    options that are on."""
    sizes = [f"{SIZE_NAMES[k]}={v}" for k, v in params.items() if k in SIZE_NAMES]
    if params.get("kv_heads") not in (None, params.get("heads")):
        sizes.append(f"n_kv_head={params['kv_heads']}")
    if "bias" in params:
        sizes.append("bias" if params["bias"] else "no bias")
    if params.get("causal"):
        sizes.append(f"causal={params['causal']}")
    return f"bench {command}  " + "  ".join(sizes)


def bench_estimate(race: Race, seconds: float, calls: int, rate: float) -> str:
    """The line a long bench says first, on stderr."""
    return (f"bench {race.command}: {format_flops(race.flops)} a call x {counted(calls, 'call')} at about "
            f"{rate / 1e9:.0f} "
            f"GFLOP/s (a matmul, measured here) takes {_duration(seconds)} or more; --runs or smaller sizes "
            "make it shorter")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"about {seconds:.0f} s"
    if seconds < 90 * 60:
        return f"about {seconds / 60:.0f} min"
    return f"about {seconds / 3600:.1f} h"


def show_bench(out: Console, result: BenchResult) -> None:
    p = result.params
    out.print(FittedText(f"{bench_header(result.command, p)}\n{p['device']}, {p['dtype']}: median of "
                         f"{counted(p['runs'], 'run')} "
                   f"after {p['warmup']} warm-up; {format_flops(result.flops)} a call", style="bold"))
    columns = [Column("contender"), Column("median ms", "right"), Column("GFLOP/s", "right", drop=3),
               Column("peak memory", "right"), Column("vs first", "right", drop=1),
               Column("max |diff|", "right", drop=2)]
    first = result.contenders[0].median_ms
    rows = [[cell(broken(c.name)), *(cell(whole(text)) for text in (
                f"{c.median_ms:.3f}", f"{c.gflops_per_s:.1f}", _peak_text(result, c), f"{c.median_ms / first:.2f}x",
                f"{c.max_abs_diff:.1e}"))] for c in result.contenders]
    out.print(FittedTable(columns, rows, shrink=[0]))
    for line in memory_lines(result):
        out.print(FittedText(line))
    if result.backends:
        backends = Table(title="SDPA backends on CUDA for these inputs", box=box.SIMPLE_HEAD, title_justify="left",
                         pad_edge=False)
        backends.add_column("backend", no_wrap=True)
        backends.add_column("eligible", no_wrap=True)
        backends.add_column("why not", overflow="fold")
        for b in result.backends:
            backends.add_row(b.name, "yes" if b.eligible else "no", Text(b.why_not))
        out.print(backends)


def _peak_text(result: BenchResult, c: Contender) -> str:
    return "n/a" if c.peak_bytes is None else format_bytes(result.inputs_bytes + c.peak_bytes)


def memory_lines(result: BenchResult) -> list[str]:
    traced = result.contenders[0]
    lines = [f"peak memory: inputs and weights ({format_bytes(result.inputs_bytes)}) plus the most one call "
             f"holds at once, measured with {result.memory_method.split(':')[0]}"]
    if traced.peak_bytes is not None:
        measured = result.inputs_bytes + traced.peak_bytes
        lines.append(f"attnscope estimates the traced path at {format_bytes(result.estimate_bytes)} "
                     f"({result.estimate_bytes / max(measured, 1):.2f}x the measured {format_bytes(measured)})")
    return lines


def bench_json(result: BenchResult) -> dict[str, Any]:
    return {
        "command": f"bench {result.command}",
        "params": result.params,
        "flops": result.flops,
        "contenders": [{"name": c.name, "median_ms": c.median_ms, "gflops_per_s": c.gflops_per_s,
                        "peak_bytes": c.peak_bytes, "max_abs_diff": finite(c.max_abs_diff)}
                       for c in result.contenders],
        "memory_method": result.memory_method,
        "inputs_bytes": result.inputs_bytes,
        "estimate_bytes": result.estimate_bytes,
        "backends": [{"name": b.name, "eligible": b.eligible, "why_not": b.why_not} for b in result.backends],
    }
