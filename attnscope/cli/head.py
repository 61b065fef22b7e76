"""`attnscope head`: one head of a transformer (BERT, RoBERTa, GPT-2, LLaMA, Mistral, Qwen2, Gemma 2): its
weights read lazily, and with --text its attention on a sentence, running only as far as the layer asked.
"""

from __future__ import annotations

from typing import Annotated

import typer

from attnscope.cli.common import Page, exporting, max_memory_bytes
from attnscope.cli.errors import reported
from attnscope.cli.options import Debug, Force, HtmlPage, Json, MaxMemory, Svg, not_empty

HEAD_EXAMPLES = """Examples:

  attnscope head --model ./llama-dir --layer 3 --head 17

  attnscope head --model ./mistral-dir --layer 1 --head 0 --text "The cat sat on the mat."

  attnscope head --model gpt2 --layer 5 --head 1 --text "The cat sat on the mat." --save head.safetensors"""

# Options `head` and `bert` share (declared once, as the house style asks).
Layer = Annotated[int, typer.Option("--layer", min=0, help="Layer, from 0.")]
Head = Annotated[int, typer.Option("--head", min=0, help="Head within the layer, from 0 (a query head; with grouped-query attention the table names the KV head that serves it).")]
Text = Annotated[str | None, typer.Option("--text", help="Run the model on this sentence, layers 0 to --layer only, and show every step of that layer's attention and this head's pattern.")]
AllHeads = Annotated[bool, typer.Option("--all-heads", help="With --text: draw every head of the layer as a grid of small heatmaps, with a table of what each does: entropy, first-token sink, previous, self, distance, kind (docs/heads.md).", rich_help_panel="Output")]
HeadSave = Annotated[str | None, typer.Option("--save", metavar="FILE", callback=not_empty, help="Write the head's weights and every step shown (the head's under their names, the layer's as layer.NAME) to .safetensors, .npz or .pt.", rich_help_panel="Output")]
MODEL_HELP = ("A folder with config.json and model.safetensors (or its shards, or pytorch_model.bin), or a Hugging "
              "Face model name found in the local cache.")


def head(
    model: Annotated[str, typer.Option("--model", help=MODEL_HELP)],
    layer: Layer = 0,
    head: Head = 0,
    text: Text = None,
    all_heads: AllHeads = False,
    json: Json = False,
    save: HeadSave = None,
    svg: Svg = None,
    html: HtmlPage = None,
    force: Force = False,
    max_memory: MaxMemory = None,
    debug: Debug = False,
) -> None:
    """One attention head of a transformer: where it lives in the checkpoint, and (with --text) what it does."""
    run_command("head", model, layer, head, text, all_heads=all_heads, json=json, save=save, svg=svg, html=html,
                force=force, max_memory=max_memory, debug=debug)


def run_command(command: str, model: str, layer: int, head: int, text: str | None, *, all_heads: bool, json: bool,
                save: str | None, svg: str | None, html: str | None, force: bool, max_memory: str | None,
                debug: bool) -> None:
    """What `head` and `bert` do: the same run, the same output."""
    from attnscope import render

    page = Page()
    with reported(debug), exporting(svg, html, force=force, json=json, title=f"attnscope {command}",
                                    page=page) as out:
        from attnscope.runs.head import HeadOptions, run_head
        from attnscope.views.sources import from_head

        options = HeadOptions(model=model, layer=layer, head=head, text=text, save=save, force=force,
                              max_memory=max_memory_bytes(max_memory), command=command, all_heads=all_heads)
        status = render.console(stderr=True)
        if status.is_terminal:  # a spinner while it reads and runs; nothing on a pipe
            result = run_head(options, progress=lambda message: status.status(message))
        else:
            result = run_head(options)
        page.of(result, from_head)
        if json:
            render.emit_json(render.head_json(result))
        else:
            render.show_head(out, result)


def register(app: typer.Typer) -> None:
    app.command("head", epilog=HEAD_EXAMPLES)(head)
