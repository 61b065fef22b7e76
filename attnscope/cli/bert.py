"""`attnscope bert`: one head's weights, and with --text its attention on a sentence."""

from __future__ import annotations

from typing import Annotated

import typer

from attnscope.cli.errors import reported
from attnscope.cli.options import Debug, Force, Json, Save

BERT_EXAMPLES = """Examples:

  attnscope bert --layer 0 --head 0

  attnscope bert --model ./my-bert --layer 3 --head 7 --save head.safetensors

  attnscope bert --layer 5 --head 2 --text "The cat sat on the mat because it was tired." """


def bert(
    layer: Annotated[int, typer.Option("--layer", min=0, help="Layer, from 0.")] = 0,
    head: Annotated[int, typer.Option("--head", min=0, help="Head within the layer, from 0.")] = 0,
    model: Annotated[str, typer.Option("--model", help="A Hugging Face model name (through the local cache) or a folder with config.json and model.safetensors or pytorch_model.bin.")] = "bert-base-uncased",
    text: Annotated[str | None, typer.Option("--text", help="Run the model on this sentence and show this head's attention pattern.")] = None,
    json: Json = False,
    save: Save = None,
    force: Force = False,
    debug: Debug = False,
) -> None:
    """One BERT head: its slice of the query/key/value/output weights, and (with --text) its attention."""
    from attnscope import render

    with reported(debug):
        from attnscope.models import bert as core
        from attnscope.models import hub
        from attnscope.tensors import check_writable, save_tensors

        if save:
            check_writable(save, force)
        status = render.console(stderr=True)
        with status.status(f"locating {model}"):
            folder = hub.locate(model, need_tokenizer=text is not None)
            info = core.inspect(folder)
            core.check_position(info, layer, head)
        with status.status(f"reading layer {layer}, head {head}"):
            weights = core.head_weights(info, layer, head)
        sentence = None
        if text is not None:
            with status.status("running the model on the text"):
                sentence = core.run_text(weights, text)
        saved = None
        if save:
            tensors = weights.as_torch()
            if sentence is not None:
                tensors["attention"] = sentence.trace["attention"]
            meta = {"sources": weights.sources, "model": str(info.folder), "layer": layer, "head": head,
                    "tokens": sentence.tokens if sentence else None}
            saved = save_tensors(tensors, save, force=force, metadata=meta)
        if json:
            render.emit_json(render.bert_json(model, text, weights, sentence, saved))
        else:
            render.show_bert(render.console(), weights, sentence, saved)


def register(app: typer.Typer) -> None:
    app.command("bert", epilog=BERT_EXAMPLES)(bert)
