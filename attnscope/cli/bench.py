"""`attnscope bench sdpa|mha`: the traced path against PyTorch's fused attention, timed side by side."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer

from attnscope.cli.common import exporting
from attnscope.cli.errors import reported
from attnscope.cli.options import (
    AttentionCommand,
    Batch,
    Bias,
    CausalOpt,
    Debug,
    DFeat,
    Dk,
    Dv,
    ExportForce,
    Heads,
    Html,
    Json,
    Nk,
    NkOrNq,
    Nq,
    Svg,
)

if TYPE_CHECKING:
    from attnscope.bench import Race

BENCH_EXAMPLES = """Examples:

  attnscope bench sdpa

  attnscope bench mha"""

bench_app = typer.Typer(no_args_is_help=True, help="Time the traced path against PyTorch's fused attention.",
                        epilog=BENCH_EXAMPLES)

Device = Annotated[str, typer.Option("--device", help="cpu or cuda.")]
Dtype = Annotated[str, typer.Option("--dtype", help="float32, float64, float16 or bfloat16.")]
Runs = Annotated[int, typer.Option("--runs", min=1, help="Timed runs per contender; the median is reported.")]
Warmup = Annotated[int, typer.Option("--warmup", min=0, help="Untimed runs first (caches, lazy initialisation).")]

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
def bench_sdpa(
    batch: Batch = 8,
    nq: Nq = 1024,
    nk: Nk = 1024,
    dk: Dk = 64,
    dv: Dv = 64,
    causal: CausalOpt = None,
    device: Device = "cpu",
    dtype: Dtype = "float32",
    runs: Runs = 20,
    warmup: Warmup = 3,
    json: Json = False,
    svg: Svg = None,
    html: Html = None,
    force: ExportForce = False,
    debug: Debug = False,
) -> None:
    """Time attnscope's traced sdpa and F.scaled_dot_product_attention on the same inputs."""
    from attnscope import cost

    mode = causal.value if causal else None
    _race(debug, json, runs, warmup, (svg, html, force),
          needed=lambda: cost.sdpa_bytes(batch, nq, nk, dk, dv, masked=causal is not None),
          setup=lambda bench: bench.sdpa_race(batch, nq, nk, dk, dv, causal=mode, device=device, dtype=dtype))


@bench_app.command("mha", cls=AttentionCommand, epilog=MHA_EXAMPLES)
def bench_mha(
    batch: Batch = 8,
    nq: Nq = 256,
    nk: NkOrNq = None,
    d_feat: DFeat = 512,
    heads: Heads = 8,
    kv_heads: Annotated[int | None, typer.Option("--kv-heads", min=1, help="n_kv_head: time grouped-query attention, F.scaled_dot_product_attention(enable_gqa=True) against K/V expanded first.  \\[default: --heads]")] = None,
    bias: Bias = True,
    causal: CausalOpt = None,
    device: Device = "cpu",
    dtype: Dtype = "float32",
    runs: Runs = 20,
    warmup: Warmup = 3,
    json: Json = False,
    svg: Svg = None,
    html: Html = None,
    force: ExportForce = False,
    debug: Debug = False,
) -> None:
    """Time attnscope's MultiHeadAttention (traced and record=False) and torch.nn.MultiheadAttention."""
    from attnscope import cost
    from attnscope.runs.common import check_heads, check_kv_heads

    n_K, mode = nq if nk is None else nk, causal.value if causal else None

    def needed() -> int:
        check_heads(d_feat, heads, from_file=False, has_d_head=False)
        check_kv_heads(heads, kv_heads)
        return cost.mha_bytes(batch, nq, n_K, d_feat, heads, bias=bias, cross=n_K != nq, masked=mode is not None,
                              n_kv_head=kv_heads)

    _race(debug, json, runs, warmup, (svg, html, force), needed=needed,
          setup=lambda bench: bench.mha_race(batch, nq, n_K, d_feat, heads, bias=bias, causal=mode, device=device,
                                             dtype=dtype, kv_heads=kv_heads))


SHRINK = "shrink --batch, --nq or --nk"


def _race(debug: bool, json: bool, runs: int, warmup: int, exports: tuple[str | None, str | None, bool], *,
          needed: Callable[[], int], setup: Callable[[object], Race]) -> None:
    """Check the options, guard memory (every contender's inputs and one traced run's worth more), say how
    long a long bench will take, time the contenders under a progress bar, show the result."""
    from attnscope import render

    svg, html, force = exports
    with reported(debug, oom_advice=SHRINK), exporting(svg, html, force=force, json=json,
                                                       title="attnscope bench") as out:
        from attnscope.runs.common import guard_memory

        guard_memory(2 * needed(), None, advice=SHRINK)
        from attnscope import bench  # torch: only once the options and the memory are known to be fine

        race = setup(bench)
        seconds, calls, rate = bench.seconds_estimate(race, runs, warmup)
        if seconds > LONG_SECONDS:
            render.info(render.bench_estimate(race, seconds, calls, rate))
        with render.progress_bar(len(race.candidates) * (runs + warmup)) as tick:
            result = bench.run(race, runs, warmup, tick)
        if json:
            render.emit_json(render.bench_json(result))
        else:
            render.show_bench(out, result)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
