"""`attnscope bench sdpa|mha`: the traced path against PyTorch's fused attention, timed side by side."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import typer

from attnscope.cli.options import (
    AttentionCommand,
    Batch,
    Bias,
    CausalOpt,
    DFeat,
    Dk,
    Dv,
    Export,
    Heads,
    Nk,
    NkOrNq,
    Nq,
    grouped,
)

BENCH_EXAMPLES = """Examples:

  attnscope bench sdpa

  attnscope bench mha"""

bench_app = typer.Typer(no_args_is_help=True, help="Time the traced path against PyTorch's fused attention.",
                        epilog=BENCH_EXAMPLES)

Device = Annotated[str, typer.Option("--device", help="cpu or cuda.")]
Dtype = Annotated[str, typer.Option("--dtype", help="float32, float64, float16 or bfloat16.")]
Runs = Annotated[int, typer.Option("--runs", min=1, help="Timed runs per contender; the median is reported.")]
Warmup = Annotated[int, typer.Option("--warmup", min=0, help="Untimed runs first (caches, lazy initialisation).")]


@dataclass(frozen=True)
class Race:
    """What each bench asks of its race, declared once: the mask, the device and dtype, how many runs."""

    causal: CausalOpt = None
    device: Device = "cpu"
    dtype: Dtype = "float32"
    runs: Runs = 20
    warmup: Warmup = 3

# Defaults sized for a bench: realistic shapes (heads of 64, as BERT's), about a second per contender on a
# 2-core CPU with the default --runs (docs/performance.md has the numbers).
SDPA_EXAMPLES = """Examples:

  attnscope bench sdpa

  attnscope bench sdpa --batch 4 --nq 512 --nk 1024 --causal lower-right

  attnscope bench sdpa --nq 256 --nk 256 --dtype float64 --json"""

MHA_EXAMPLES = """Examples:

  attnscope bench mha

  attnscope bench mha --nq 128 --d-feat 768 --heads 12

  attnscope bench mha --nq 64 --heads 8 --kv-heads 2 --causal --runs 10"""

LONG_SECONDS = 5.0  # a bench expected to take longer says so on stderr first, so a pipe is not silent


@bench_app.command("sdpa", cls=AttentionCommand, epilog=SDPA_EXAMPLES)
@grouped
def bench_sdpa(
    batch: Batch = 8,
    nq: Nq = 1024,
    nk: Nk = 1024,
    dk: Dk = 64,
    dv: Dv = 64,
    setup: Race = Race(),
    export: Export = Export(),
) -> None:
    """Time attnscope's traced sdpa and F.scaled_dot_product_attention on the same inputs."""
    _race("sdpa", batch, nq, nk, setup, export, dk=dk, dv=dv)


@bench_app.command("mha", cls=AttentionCommand, epilog=MHA_EXAMPLES)
@grouped
def bench_mha(
    batch: Batch = 8,
    nq: Nq = 256,
    nk: NkOrNq = None,
    d_feat: DFeat = 512,
    heads: Heads = 8,
    kv_heads: Annotated[int | None, typer.Option("--kv-heads", min=1, help="n_kv_head: time grouped-query attention, F.scaled_dot_product_attention(enable_gqa=True) against K/V expanded first.  \\[default: --heads]")] = None,
    bias: Bias = True,
    setup: Race = Race(),
    export: Export = Export(),
) -> None:
    """Time attnscope's MultiHeadAttention (traced and record=False) and torch.nn.MultiheadAttention."""
    _race("mha", batch, nq, nk, setup, export, d_feat=d_feat, heads=heads, kv_heads=kv_heads, bias=bias)


def _race(command: str, batch: int, nq: int, nk: int | None, setup: Race, export: Export, **sizes: Any) -> None:
    """Prepare the race (runs/bench.py), say how long a long bench will take, time the contenders under a
    progress bar, show the result."""
    from attnscope import render
    from attnscope.runs.bench import SHRINK, BenchOptions, prepare

    asked = BenchOptions(command, batch, nq, nk, setup.causal.value if setup.causal else None, setup.device,
                         setup.dtype, **sizes)
    runs, warmup = setup.runs, setup.warmup

    with export.around("bench", oom_advice=SHRINK) as out:
        race = prepare(asked)
        from attnscope.runs.race import run, seconds_estimate

        seconds, calls, rate = seconds_estimate(race, runs, warmup)
        if seconds > LONG_SECONDS:
            render.info(render.bench_estimate(race, seconds, calls, rate))
        with render.progress_bar(len(race.candidates) * (runs + warmup)) as tick:
            result = run(race, runs, warmup, tick)
        if export.json:
            render.emit_json(render.bench_json(result))
        else:
            render.show_bench(out, result)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
