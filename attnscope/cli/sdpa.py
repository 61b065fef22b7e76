"""`attnscope sdpa`: parse options, call attnscope.runs.sdpa, hand the result to render."""

from __future__ import annotations

from typing import Annotated

import typer

from attnscope.cli.common import Page, exporting, max_memory_bytes, show_run
from attnscope.cli.errors import OOM_ADVICE, reported
from attnscope.cli.options import (
    Alibi,
    AttentionCommand,
    AttnScale,
    Batch,
    Cache,
    CausalOpt,
    Check,
    Chunk,
    Debug,
    Dk,
    Dv,
    FloorScale,
    Force,
    HeatmapBatch,
    HeatmapHead,
    HeatmapOpt,
    HtmlPage,
    Json,
    KFile,
    Layout,
    MaskFile,
    MaxMemory,
    Meta,
    NkOrCache,
    Nq,
    Pad,
    PositionBias,
    QFile,
    QkNormOpt,
    RopeBase,
    RopeFraction,
    RopeOpt,
    RopePairing,
    Save,
    Seed,
    ShowMask,
    SinksOpt,
    Softcap,
    Stats,
    Svg,
    TemperatureOpt,
    Values,
    VFile,
    Window,
    WindowSideOpt,
)

SDPA_EXAMPLES = """Examples:

  attnscope sdpa --nq 30 --nk 50 --dk 128 --dv 256

  attnscope sdpa --q q.npy --k k.npy --v v.npy --causal --check

  attnscope sdpa --batch 1 --nq 2 --cache 6 --dk 8 --dv 8 --rope --window 4 --show-mask"""


def sdpa(
    batch: Batch = 3,
    nq: Nq = 30,
    nk: NkOrCache = None,
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
    show_mask: ShowMask = False,
    scale: Annotated[float | None, typer.Option("--scale", help="Replace 1/sqrt(d_K), as F.scaled_dot_product_attention(scale=...).", rich_help_panel="Masks")] = None,
    check: Check = False,
    json: Json = False,
    save: Save = None,
    svg: Svg = None,
    html: HtmlPage = None,
    force: Force = False,
    values: Values = False,
    stats: Stats = False,
    heatmap: HeatmapOpt = False,
    heatmap_batch: HeatmapBatch = 0,
    heatmap_head: HeatmapHead = 0,
    window: Window = None,
    window_side: WindowSideOpt = None,
    softcap: Softcap = None,
    alibi: Alibi = False,
    position_bias: PositionBias = None,
    rope: RopeOpt = False,
    rope_base: RopeBase = None,
    rope_fraction: RopeFraction = None,
    rope_pairing: RopePairing = None,
    chunk: Chunk = None,
    temperature_tuning: TemperatureOpt = False,
    floor_scale: FloorScale = None,
    attn_scale: AttnScale = None,
    cache: Cache = 0,
    sinks: SinksOpt = None,
    qk_norm: QkNormOpt = None,
    meta: Meta = False,
    max_memory: MaxMemory = None,
    debug: Debug = False,
) -> None:
    """Scaled dot-product attention: softmax(Q Kᵀ / √d_K) V, every step shown."""

    page = Page()
    with reported(debug, oom_advice=OOM_ADVICE), exporting(svg, html, force=force, json=json,
                                                          title="attnscope sdpa", page=page) as out:
        from attnscope.runs.sdpa import SdpaOptions, run_sdpa

        options = SdpaOptions(
            batch=batch, nq=nq, nk=nk, dk=dk, dv=dv, seed=seed, q=q, k=k, v=v, x=x, wq=wq, wk=wk, wv=wv,
            layout=layout.value, causal=causal.value if causal else None, mask=mask, pad=pad, scale=scale,
            check=check, meta=meta, max_memory=max_memory_bytes(max_memory), save=save, force=force, heatmap=heatmap,
            heatmap_batch=heatmap_batch, heatmap_head=heatmap_head, window=window, softcap=softcap, alibi=alibi,
            position_bias=position_bias, rope=rope, rope_base=rope_base, cache=cache, show_mask=show_mask, chunk=chunk,
            rope_fraction=rope_fraction, rope_pairing=rope_pairing.value if rope_pairing else None,
            temperature_tuning=temperature_tuning, floor_scale=floor_scale, attn_scale=attn_scale, sinks=sinks,
            window_side=window_side.value if window_side else "left", qk_norm=qk_norm.value if qk_norm else None,
        )
        show_run(out, run_sdpa(options), json=json, values=values, stats=stats, page=page)


def register(app: typer.Typer) -> None:
    app.command("sdpa", cls=AttentionCommand, epilog=SDPA_EXAMPLES)(sdpa)
