"""`attnscope mask`: draw a combined attention mask and say it in every library's words."""

from __future__ import annotations

from typing import Annotated

import typer

from attnscope.cli.common import exporting
from attnscope.cli.errors import reported
from attnscope.cli.options import (
    AttentionCommand,
    Cache,
    CausalOpt,
    Chunk,
    Debug,
    ExportForce,
    Html,
    Json,
    MaskFile,
    Pad,
    Svg,
    Window,
)

MASK_EXAMPLES = """Examples:

  attnscope mask --nq 6 --causal

  attnscope mask --nq 4 --cache 6 --chunk 4

  attnscope mask --nq 5 --nk 8 --causal lower-right --pad 2 --json"""


def mask(
    nq: Annotated[int, typer.Option("--nq", min=1, help="n_Q: number of queries.")] = 8,
    nk: Annotated[int | None, typer.Option("--nk", min=1, help="n_K: number of keys.  \\[default: --nq; with --cache N, N + --nq]")] = None,
    causal: CausalOpt = None,
    window: Window = None,
    chunk: Chunk = None,
    pad: Pad = 0,
    cache: Cache = 0,
    mask_file: MaskFile = None,
    json: Json = False,
    svg: Svg = None,
    html: Html = None,
    force: ExportForce = False,
    debug: Debug = False,
) -> None:
    """Draw the combined mask (■ may attend, · masked), name its alignment, and write it for
    F.scaled_dot_product_attention, nn.MultiheadAttention, transformers, flash-attn and FlexAttention."""
    with reported(debug), exporting(svg, html, force=force, json=json, title="attnscope mask") as out:
        from attnscope import render
        from attnscope.render.mask import mask_command_json, show_mask
        from attnscope.runs.mask import MaskOptions, run_mask

        options = MaskOptions(nq=nq, nk=nk, causal=causal.value if causal else None, window=window, pad=pad,
                              cache=cache, mask=mask_file, chunk=chunk)
        view, params = run_mask(options)
        if json:
            render.emit_json(mask_command_json(view, params))
        else:
            show_mask(out, view)


def register(app: typer.Typer) -> None:
    app.command("mask", cls=AttentionCommand, epilog=MASK_EXAMPLES)(mask)
