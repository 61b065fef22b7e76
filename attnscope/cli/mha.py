"""`attnscope mha`: parse options, call attnscope.runs.mha, hand the result to render."""

from __future__ import annotations

from typing import Annotated

import typer

from attnscope.cli.common import exporting, max_memory_bytes, show_run
from attnscope.cli.errors import reported
from attnscope.cli.options import (
    Alibi,
    AttentionCommand,
    Batch,
    Bias,
    Cache,
    CausalOpt,
    Check,
    Debug,
    DFeat,
    Force,
    Heads,
    HeatmapBatch,
    HeatmapHead,
    HeatmapOpt,
    Html,
    Json,
    KFile,
    MaskFile,
    MaxMemory,
    Meta,
    NkOrNq,
    Nq,
    Pad,
    QFile,
    QkNormOpt,
    RopeBase,
    RopeOpt,
    Save,
    Seed,
    ShowMask,
    Softcap,
    Stats,
    Svg,
    Values,
    VFile,
    Window,
)

MHA_EXAMPLES = """Examples:

  attnscope mha --d-feat 200 --heads 5

  attnscope mha --nq 16 --nk 40 --heads 4 --d-feat 64 --check

  attnscope mha --d-feat 4096 --heads 32 --kv-heads 8 --rope --causal --batch 1 --nq 8192 --meta"""


def mha(
    batch: Batch = 128,
    nq: Nq = 32,
    nk: NkOrNq = None,
    d_feat: DFeat = 200,
    heads: Heads = 5,
    kv_heads: Annotated[int | None, typer.Option("--kv-heads", min=1, help="n_kv_head: key/value heads, each shared by --heads / --kv-heads query heads (GQA; 1 is MQA).  \\[default: --heads]", rich_help_panel="Variants")] = None,
    d_head: Annotated[int | None, typer.Option("--d-head", min=1, help="d_head, decoupled from d_feat / n_head (Gemma): W_q maps d_feat to n_head · d_head.", rich_help_panel="Variants")] = None,
    scale: Annotated[float | None, typer.Option("--scale", help="Replace 1/sqrt(d_head); Gemma 2's query_pre_attn_scalar q gives q ** -0.5.", rich_help_panel="Variants")] = None,
    bias: Bias = True,
    dropout: Annotated[float, typer.Option("--dropout", help="Dropout on the attention weights, in \\[0, 1).")] = 0.0,
    seed: Seed = 0,
    q: QFile = None,
    k: KFile = None,
    v: VFile = None,
    causal: CausalOpt = None,
    mask: MaskFile = None,
    pad: Pad = 0,
    show_mask: ShowMask = False,
    check: Check = False,
    json: Json = False,
    save: Save = None,
    svg: Svg = None,
    html: Html = None,
    force: Force = False,
    values: Values = False,
    stats: Stats = False,
    heatmap: HeatmapOpt = False,
    heatmap_batch: HeatmapBatch = 0,
    heatmap_head: HeatmapHead = 0,
    all_heads: Annotated[bool, typer.Option("--all-heads", help="Draw every head of batch element --heatmap-batch as a grid of small heatmaps, with a table of what each does: entropy, first-token sink, previous, self, distance, kind (docs/heads.md).", rich_help_panel="Output")] = False,
    window: Window = None,
    softcap: Softcap = None,
    alibi: Alibi = False,
    rope: RopeOpt = False,
    rope_base: RopeBase = None,
    cache: Cache = 0,
    qk_norm: QkNormOpt = None,
    meta: Meta = False,
    max_memory: MaxMemory = None,
    debug: Debug = False,
) -> None:
    """Multi-head attention: project, split into heads, SDPA in every head, merge, project."""

    with reported(debug), exporting(svg, html, force=force, json=json, title="attnscope mha") as out:
        from attnscope.runs.mha import MhaOptions, run_mha

        options = MhaOptions(
            batch=batch, nq=nq, nk=nk, d_feat=d_feat, heads=heads, bias=bias, dropout=dropout, seed=seed,
            q=q, k=k, v=v, causal=causal.value if causal else None, mask=mask, pad=pad, check=check, meta=meta,
            max_memory=max_memory_bytes(max_memory), save=save, force=force, heatmap=heatmap,
            heatmap_batch=heatmap_batch, heatmap_head=heatmap_head, window=window, softcap=softcap, alibi=alibi,
            rope=rope, rope_base=rope_base, cache=cache, show_mask=show_mask,
            qk_norm=qk_norm.value if qk_norm else None, kv_heads=kv_heads, d_head=d_head,
            scale=scale, all_heads=all_heads,
        )
        show_run(out, run_mha(options), json=json, values=values, stats=stats)


def register(app: typer.Typer) -> None:
    app.command("mha", cls=AttentionCommand, epilog=MHA_EXAMPLES)(mha)
