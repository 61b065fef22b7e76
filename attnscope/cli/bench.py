"""`attnscope bench sdpa|mha`: the traced path against PyTorch's fused attention, timed side by side."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

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
    Heads,
    Json,
    Nk,
    NkOrNq,
    Nq,
)

if TYPE_CHECKING:
    from attnscope.bench import BenchResult

bench_app = typer.Typer(no_args_is_help=True, help="Time the traced path against PyTorch's fused attention.")

Device = Annotated[str, typer.Option("--device", help="cpu or cuda.")]
Dtype = Annotated[str, typer.Option("--dtype", help="float32, float64, float16 or bfloat16.")]
Runs = Annotated[int, typer.Option("--runs", min=1, help="Timed runs per contender; the median is reported.")]
Warmup = Annotated[int, typer.Option("--warmup", min=0, help="Untimed runs first (caches, lazy initialisation).")]

SDPA_EXAMPLES = """Examples:

  attnscope bench sdpa

  attnscope bench sdpa --batch 8 --nq 1024 --nk 1024 --dk 64 --dv 64 --causal

  attnscope bench sdpa --device cuda --dtype float16 --nq 4096 --nk 4096 --dk 128 --dv 128"""

MHA_EXAMPLES = """Examples:

  attnscope bench mha

  attnscope bench mha --batch 8 --nq 512 --d-feat 768 --heads 12 --json

  attnscope bench mha --device cuda --dtype bfloat16 --nq 2048 --d-feat 1024 --heads 16"""


@bench_app.command("sdpa", cls=AttentionCommand, epilog=SDPA_EXAMPLES)
def bench_sdpa(
    batch: Batch = 3,
    nq: Nq = 30,
    nk: Nk = 50,
    dk: Dk = 128,
    dv: Dv = 256,
    causal: CausalOpt = None,
    device: Device = "cpu",
    dtype: Dtype = "float32",
    runs: Runs = 20,
    warmup: Warmup = 3,
    json: Json = False,
    debug: Debug = False,
) -> None:
    """Time attnscope's traced sdpa and F.scaled_dot_product_attention on the same inputs."""
    from attnscope import cost

    mode = causal.value if causal else None
    _race(debug, json, device, dtype, contenders=2, runs=runs, warmup=warmup,
          needed=lambda: cost.sdpa_bytes(batch, nq, nk, dk, dv, masked=causal is not None),
          work=lambda bench, tick: bench.bench_sdpa(batch, nq, nk, dk, dv, causal=mode, device=device, dtype=dtype,
                                                    runs=runs, warmup=warmup, tick=tick))


@bench_app.command("mha", cls=AttentionCommand, epilog=MHA_EXAMPLES)
def bench_mha(
    batch: Batch = 128,
    nq: Nq = 32,
    nk: NkOrNq = None,
    d_feat: DFeat = 200,
    heads: Heads = 5,
    bias: Bias = True,
    causal: CausalOpt = None,
    device: Device = "cpu",
    dtype: Dtype = "float32",
    runs: Runs = 20,
    warmup: Warmup = 3,
    json: Json = False,
    debug: Debug = False,
) -> None:
    """Time attnscope's MultiHeadAttention (traced and record=False) and torch.nn.MultiheadAttention."""
    from attnscope import cost
    from attnscope.runs.common import check_heads

    n_K, mode = nq if nk is None else nk, causal.value if causal else None

    def needed() -> int:
        check_heads(d_feat, heads, from_file=False)
        return cost.mha_bytes(batch, nq, n_K, d_feat, heads, bias=bias, cross=n_K != nq, masked=mode is not None)

    _race(debug, json, device, dtype, contenders=3, runs=runs, warmup=warmup, needed=needed,
          work=lambda bench, tick: bench.bench_mha(batch, nq, n_K, d_feat, heads, bias=bias, causal=mode,
                                                   device=device, dtype=dtype, runs=runs, warmup=warmup, tick=tick))


def _race(debug: bool, json: bool, device: str, dtype: str, *, contenders: int, runs: int, warmup: int,
          needed: Callable[[], int], work: Callable[[Any, Callable[[str], None]], BenchResult]) -> None:
    """Check the options, guard memory (every contender's inputs and one traced run's worth more), time
    the contenders under a progress bar, show the result."""
    from attnscope import render

    with reported(debug):
        from attnscope.runs.common import guard_memory

        guard_memory(2 * needed(), None)
        from attnscope import bench  # torch: only once the options and the memory are known to be fine

        bench.resolve(device, dtype)
        with render.progress_bar(contenders * (runs + warmup)) as tick:
            result = work(bench, tick)
        if json:
            render.emit_json(render.bench_json(result))
        else:
            render.show_bench(render.console(), result)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
