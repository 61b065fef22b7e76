"""`attnscope bench sdpa|mha`: the traced path against PyTorch's fused attention, timed side by side."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from attnscope.cli_options import (
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
    from attnscope.cli import reported

    with reported(debug):
        from attnscope import cost
        from attnscope.runs import guard_memory

        guard_memory(2 * cost.sdpa_bytes(batch, nq, nk, dk, dv, masked=causal is not None), None)
        _bench().resolve(device, dtype)
        result = _with_progress(2 * (runs + warmup), lambda tick: _bench().bench_sdpa(
            batch, nq, nk, dk, dv, causal=causal.value if causal else None, device=device, dtype=dtype,
            runs=runs, warmup=warmup, tick=tick))
        _show(result, json)


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
    from attnscope.cli import reported

    with reported(debug):
        from attnscope import cost
        from attnscope.errors import UsageError
        from attnscope.runs import guard_memory

        n_K = nq if nk is None else nk
        if d_feat % heads:
            near = " or ".join(f"--heads {h}" for h in cost.divisors_near(d_feat, heads))
            raise UsageError(f"--d-feat {d_feat} is not divisible by --heads {heads}; try {near}")
        guard_memory(2 * cost.mha_bytes(batch, nq, n_K, d_feat, heads, bias=bias, cross=n_K != nq,
                                        masked=causal is not None), None)
        _bench().resolve(device, dtype)
        result = _with_progress(3 * (runs + warmup), lambda tick: _bench().bench_mha(
            batch, nq, n_K, d_feat, heads, bias=bias, causal=causal.value if causal else None, device=device,
            dtype=dtype, runs=runs, warmup=warmup, tick=tick))
        _show(result, json)


def _bench():  # type: ignore[no-untyped-def]
    from attnscope import bench

    return bench


def _with_progress(total: int, work):  # type: ignore[no-untyped-def]
    from attnscope import render

    with render.progress_bar(total) as tick:
        return work(tick)


def _show(result: BenchResult, json: bool) -> None:
    from attnscope import render

    if json:
        render.emit_json(render.bench_json(result))
    else:
        render.show_bench(render.console(), result)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
