"""`attnscope mha`: parse options, call attnscope.runs.mha, hand the result to render."""

from __future__ import annotations

from typing import Annotated

import typer

from attnscope.cli.common import Page
from attnscope.cli.options import AttentionCommand, Batch, Bias, DFeat, Heads, NkOrNq, Nq
from attnscope.cli.shared_run import Shared, attention_command

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
    *,
    shared: Shared,
    all_heads: Annotated[bool, typer.Option("--all-heads", help="Draw every head of batch element --heatmap-batch as a grid of small heatmaps, with a table of what each does: entropy, first-token sink, previous, self, distance, kind (docs/heads.md).", rich_help_panel="Output")] = False,
    kv_lora_rank: KvLoraRank = None,
    q_lora_rank: QLoraRank = None,
    rope_head_dim: RopeHeadDim = None,
    v_head_dim: VHeadDim = None,
) -> None:
    """Multi-head attention: project, split into heads, SDPA in every head, merge, project."""

    page = Page()
    with shared.running("mha", page) as out:
        from attnscope.runs.mha import MhaOptions, run_mha

        options = MhaOptions(
            batch=batch, nq=nq, nk=nk, d_feat=d_feat, heads=heads, bias=bias, dropout=dropout, kv_heads=kv_heads,
            d_head=d_head, scale=scale, all_heads=all_heads, kv_lora_rank=kv_lora_rank, q_lora_rank=q_lora_rank,
            rope_head_dim=rope_head_dim, v_head_dim=v_head_dim, **shared.options(),
        )
        if kv_lora_rank is not None:
            from attnscope.runs.latent import run_latent

            shared.show(out, run_latent(options), page)
        else:
            shared.show(out, run_mha(options), page)


def register(app: typer.Typer) -> None:
    app.command("mha", cls=AttentionCommand, epilog=MHA_EXAMPLES)(attention_command(mha))
