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

if TYPE_CHECKING:
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
                        "peak_bytes": c.peak_bytes, "max_abs_diff": finite(c.max_abs_diff)}
                       for c in result.contenders],
        "memory_method": result.memory_method,
        "backends": [{"name": b.name, "eligible": b.eligible, "why_not": b.why_not} for b in result.backends],
    }
