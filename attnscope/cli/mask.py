"""`attnscope mask`: draw a combined attention mask and say it in every library's words."""

from __future__ import annotations

from typing import Annotated

import typer

from attnscope.cli.options import (
    AttentionCommand,
    Cache,
    CausalOpt,
    Chunk,
    Export,
    MaskFile,
    Pad,
    SinksOpt,
    Window,
    WindowSideOpt,
    grouped,
)

MASK_EXAMPLES = """Examples:

  attnscope mask --nq 6 --causal

  attnscope mask --nq 4 --cache 6 --chunk 4 --pad 2 --json

  attnscope mask --nq 8 --window 4 --window-side both --sinks"""


def mask(
    nq: Annotated[int, typer.Option("--nq", min=1, help="n_Q: number of queries.")] = 8,
    nk: Annotated[int | None, typer.Option("--nk", min=1, help="n_K: number of keys.  \\[default: --nq; with --cache N, N + --nq]")] = None,
    causal: CausalOpt = None,
    window: Window = None,
    chunk: Chunk = None,
    window_side: WindowSideOpt = None,
    sinks: SinksOpt = None,
    pad: Pad = 0,
    cache: Cache = 0,
    mask_file: MaskFile = None,
    export: Export = Export(),
) -> None:
    """Draw the combined mask (■ may attend, · masked), name its alignment, and write it for
    F.scaled_dot_product_attention, nn.MultiheadAttention, transformers, flash-attn and FlexAttention."""
    with export.around("mask") as out:
        from attnscope import render
        from attnscope.render.mask import mask_command_json, show_mask
        from attnscope.runs.mask import MaskOptions, run_mask

        options = MaskOptions(nq=nq, nk=nk, causal=causal.value if causal else None, window=window, pad=pad,
                              cache=cache, mask=mask_file, chunk=chunk,
                              window_side=window_side.value if window_side else "left", sinks=sinks)
        view, params = run_mask(options)
        if export.json:
            render.emit_json(mask_command_json(view, params))
        else:
            show_mask(out, view)


def register(app: typer.Typer) -> None:
    app.command("mask", cls=AttentionCommand, epilog=MASK_EXAMPLES)(grouped(mask))
