"""`attnscope sdpa` and `attnscope mha`: parse options, call attnscope.runs, hand the result to render."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from attnscope.cli_options import (
    AttentionCommand,
    Batch,
    Bias,
    CausalOpt,
    Check,
    Debug,
    DFeat,
    Dk,
    Dv,
    Force,
    Heads,
    HeatmapBatch,
    HeatmapOpt,
    Json,
    KFile,
    Layout,
    MaskFile,
    MaxMemory,
    Meta,
    Nk,
    NkOrNq,
    Nq,
    Pad,
    QFile,
    Save,
    Seed,
    Stats,
    Values,
    VFile,
)

if TYPE_CHECKING:
    from attnscope.runs import RunResult

SDPA_EXAMPLES = """Examples:

  attnscope sdpa --nq 30 --nk 50 --dk 128 --dv 256

  attnscope sdpa --q q.npy --k k.npy --v v.npy --causal --check

  attnscope sdpa --x x.npy --wq wq.npy --wk wk.npy --wv wv.npy --values"""

MHA_EXAMPLES = """Examples:

  attnscope mha --d-feat 200 --heads 5

  attnscope mha --nq 16 --nk 40 --heads 4 --d-feat 64 --check

  attnscope mha --d-feat 4096 --heads 32 --batch 8 --nq 1000000 --meta"""


def sdpa(
    batch: Batch = 3,
    nq: Nq = 30,
    nk: Nk = 50,
    dk: Dk = 128,
    dv: Dv = 256,
    seed: Seed = 0,
    q: QFile = None,
    k: KFile = None,
    v: VFile = None,
    x: Annotated[str | None, typer.Option("--x", metavar="FILE", help="X \\[n, p] for Q = X W_Q, K = X W_K, V = X W_V.", rich_help_panel="Inputs")] = None,
    wq: Annotated[str | None, typer.Option("--wq", metavar="FILE", help="W_Q \\[p, d_K].", rich_help_panel="Inputs")] = None,
    wk: Annotated[str | None, typer.Option("--wk", metavar="FILE", help="W_K \\[p, d_K].", rich_help_panel="Inputs")] = None,
    wv: Annotated[str | None, typer.Option("--wv", metavar="FILE", help="W_V \\[p, d_V].", rich_help_panel="Inputs")] = None,
    layout: Annotated[Layout, typer.Option("--layout", help="row: inputs \\[n, d] (PyTorch); col: inputs \\[d, n], out = V softmax(Kᵀ Q).", rich_help_panel="Inputs")] = Layout.row,
    causal: CausalOpt = None,
    mask: MaskFile = None,
    pad: Pad = 0,
    scale: Annotated[float | None, typer.Option("--scale", help="Replace 1/sqrt(d_K), as F.scaled_dot_product_attention(scale=...).", rich_help_panel="Masks")] = None,
    check: Check = False,
    json: Json = False,
    save: Save = None,
    force: Force = False,
    values: Values = False,
    stats: Stats = False,
    heatmap: HeatmapOpt = False,
    heatmap_batch: HeatmapBatch = 0,
    meta: Meta = False,
    max_memory: MaxMemory = None,
    debug: Debug = False,
) -> None:
    """Scaled dot-product attention: softmax(Q Kᵀ / √d_K) V, every step shown."""
    from attnscope.cli import reported

    with reported(debug):
        from attnscope.runs import SdpaOptions, run_sdpa

        options = SdpaOptions(
            batch=batch, nq=nq, nk=nk, dk=dk, dv=dv, seed=seed, q=q, k=k, v=v, x=x, wq=wq, wk=wk, wv=wv,
            layout=layout.value, causal=causal.value if causal else None, mask=mask, pad=pad, scale=scale,
            check=check, meta=meta, max_memory=_size(max_memory), save=save, force=force, heatmap=heatmap,
            heatmap_batch=heatmap_batch,
        )
        _show(run_sdpa(options), json=json, values=values, stats=stats)


def mha(
    batch: Batch = 128,
    nq: Nq = 32,
    nk: NkOrNq = None,
    d_feat: DFeat = 200,
    heads: Heads = 5,
    bias: Bias = True,
    dropout: Annotated[float, typer.Option("--dropout", help="Dropout on the attention weights, in \\[0, 1).")] = 0.0,
    seed: Seed = 0,
    q: QFile = None,
    k: KFile = None,
    v: VFile = None,
    causal: CausalOpt = None,
    mask: MaskFile = None,
    pad: Pad = 0,
    check: Check = False,
    json: Json = False,
    save: Save = None,
    force: Force = False,
    values: Values = False,
    stats: Stats = False,
    heatmap: HeatmapOpt = False,
    heatmap_batch: HeatmapBatch = 0,
    heatmap_head: Annotated[int, typer.Option("--heatmap-head", min=0, help="Head for --heatmap.", rich_help_panel="Output")] = 0,
    meta: Meta = False,
    max_memory: MaxMemory = None,
    debug: Debug = False,
) -> None:
    """Multi-head attention: project, split into heads, SDPA in every head, merge, project."""
    from attnscope.cli import reported

    with reported(debug):
        from attnscope.runs import MhaOptions, run_mha

        options = MhaOptions(
            batch=batch, nq=nq, nk=nk, d_feat=d_feat, heads=heads, bias=bias, dropout=dropout, seed=seed,
            q=q, k=k, v=v, causal=causal.value if causal else None, mask=mask, pad=pad, check=check, meta=meta,
            max_memory=_size(max_memory), save=save, force=force, heatmap=heatmap, heatmap_batch=heatmap_batch,
            heatmap_head=heatmap_head,
        )
        _show(run_mha(options), json=json, values=values, stats=stats)


def _size(text: str | None) -> int | None:
    from attnscope.cost import parse_size
    from attnscope.errors import UsageError

    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise UsageError(f"--max-memory: {exc}") from None


def _show(result: RunResult, *, json: bool, values: bool, stats: bool) -> None:
    from attnscope import render

    if json:
        render.emit_json(render.result_json(result, values=values, stats=stats))
    else:
        render.show_result(render.console(), result, values=values, stats=stats)
    if result.check_failed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("sdpa", cls=AttentionCommand, epilog=SDPA_EXAMPLES)(sdpa)
    app.command("mha", cls=AttentionCommand, epilog=MHA_EXAMPLES)(mha)
