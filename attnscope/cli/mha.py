"""`attnscope mha`: parse options, call attnscope.runs.mha, hand the result to render."""

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
    Bias,
    Cache,
    CausalOpt,
    Check,
    Chunk,
    Debug,
    DFeat,
    FloorScale,
    Force,
    Heads,
    HeatmapBatch,
    HeatmapHead,
    HeatmapOpt,
    HtmlPage,
    Json,
    KFile,
    MaskFile,
    MaxMemory,
    Meta,
    NkOrNq,
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

MHA_EXAMPLES = """Examples:

  attnscope mha --d-feat 200 --heads 5

  attnscope mha --d-feat 4096 --heads 32 --kv-heads 8 --rope --causal --batch 1 --nq 8192 --meta

  attnscope mha --batch 1 --nq 8 --d-feat 64 --heads 4 --kv-lora-rank 16 --q-lora-rank 24 --causal --check"""

# Multi-head latent attention (DeepSeek-V2/V3, runs/latent.py): --kv-lora-rank switches it on.
LATENT = "Latent attention (MLA)"
KvLoraRank = Annotated[int | None, typer.Option("--kv-lora-rank", min=1, metavar="R", help="Multi-head latent attention (DeepSeek-V2/V3): keys and values of every head expanded from one latent of R numbers per token (KV_latent, what a cache holds) and a rotary part shared by every head (K_pe). --d-head is then each head's no-RoPE part d_nope.", rich_help_panel=LATENT)]
QLoraRank = Annotated[int | None, typer.Option("--q-lora-rank", min=1, metavar="R", help="Compress the queries too: q_a_proj to R numbers, RMSNorm, q_b_proj (DeepSeek-V3: 1536).  \\[default: one q_proj]", rich_help_panel=LATENT)]
RopeHeadDim = Annotated[int | None, typer.Option("--rope-head-dim", min=2, metavar="D", help="d_rope: the rotary part of each query and key (even), so d_K = d_nope + d_rope (DeepSeek-V3: 64).  \\[default: d_nope / 2, rounded down to even]", rich_help_panel=LATENT)]
VHeadDim = Annotated[int | None, typer.Option("--v-head-dim", min=1, metavar="D", help="d_V: each head's value width, apart from d_K (DeepSeek-V3: 128).  \\[default: d_nope]", rich_help_panel=LATENT)]


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
    html: HtmlPage = None,
    force: Force = False,
    values: Values = False,
    stats: Stats = False,
    heatmap: HeatmapOpt = False,
    heatmap_batch: HeatmapBatch = 0,
    heatmap_head: HeatmapHead = 0,
    all_heads: Annotated[bool, typer.Option("--all-heads", help="Draw every head of batch element --heatmap-batch as a grid of small heatmaps, with a table of what each does: entropy, first-token sink, previous, self, distance, kind (docs/heads.md).", rich_help_panel="Output")] = False,
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
    kv_lora_rank: KvLoraRank = None,
    q_lora_rank: QLoraRank = None,
    rope_head_dim: RopeHeadDim = None,
    v_head_dim: VHeadDim = None,
    sinks: SinksOpt = None,
    qk_norm: QkNormOpt = None,
    meta: Meta = False,
    max_memory: MaxMemory = None,
    debug: Debug = False,
) -> None:
    """Multi-head attention: project, split into heads, SDPA in every head, merge, project."""

    page = Page()
    with reported(debug, oom_advice=OOM_ADVICE), exporting(svg, html, force=force, json=json,
                                                          title="attnscope mha", page=page) as out:
        from attnscope.runs.mha import MhaOptions, run_mha

        options = MhaOptions(
            batch=batch, nq=nq, nk=nk, d_feat=d_feat, heads=heads, bias=bias, dropout=dropout, seed=seed,
            q=q, k=k, v=v, causal=causal.value if causal else None, mask=mask, pad=pad, check=check, meta=meta,
            max_memory=max_memory_bytes(max_memory), save=save, force=force, heatmap=heatmap,
            heatmap_batch=heatmap_batch, heatmap_head=heatmap_head, window=window, softcap=softcap, alibi=alibi,
            position_bias=position_bias, rope=rope, rope_base=rope_base, cache=cache, show_mask=show_mask, chunk=chunk,
            rope_fraction=rope_fraction, rope_pairing=rope_pairing.value if rope_pairing else None,
            temperature_tuning=temperature_tuning, floor_scale=floor_scale, attn_scale=attn_scale, sinks=sinks,
            window_side=window_side.value if window_side else "left", qk_norm=qk_norm.value if qk_norm else None,
            kv_heads=kv_heads, d_head=d_head, scale=scale, all_heads=all_heads, kv_lora_rank=kv_lora_rank,
            q_lora_rank=q_lora_rank, rope_head_dim=rope_head_dim, v_head_dim=v_head_dim,
        )
        if kv_lora_rank is not None:
            from attnscope.runs.latent import run_latent

            show_run(out, run_latent(options), json=json, values=values, stats=stats, page=page)
        else:
            show_run(out, run_mha(options), json=json, values=values, stats=stats, page=page)


def register(app: typer.Typer) -> None:
    app.command("mha", cls=AttentionCommand, epilog=MHA_EXAMPLES)(mha)
