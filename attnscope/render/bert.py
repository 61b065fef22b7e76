"""`attnscope bert`: the head's weights, and with --text its steps and heatmap; and the JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from attnscope.render.console import clean
from attnscope.render.heatmap import show_heatmap
from attnscope.render.tables import step_json, steps_table

if TYPE_CHECKING:
    from pathlib import Path

    from attnscope.models.bert import HeadWeights, SentenceRun

BERT_DIMS = {"W_Q": ("d_head", "d_model"), "W_K": ("d_head", "d_model"), "W_V": ("d_head", "d_model"),
             "b_Q": ("d_head",), "b_K": ("d_head",), "b_V": ("d_head",), "W_O": ("d_model", "d_head")}


def bert_summary(weights: HeadWeights) -> str:
    info = weights.info
    return (f"{info.architecture}: {info.n_layer} layers, {info.n_head} heads, d_model {info.d_model}, "
            f"d_head {info.d_head}   ·   layer {weights.layer}, head {weights.head}\n{info.folder}")


def head_table(weights: HeadWeights) -> Table:
    from attnscope.models.checkpoint import describe, weight_stats

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("weight", style="bold cyan", no_wrap=True)
    table.add_column("dims = shape  /  from the checkpoint", overflow="fold")
    for name in ("mean", "std", "‖·‖_F"):
        table.add_column(name, justify="right", no_wrap=True)
    for name, tensor in weights.tensors.items():
        dims = BERT_DIMS[name]
        cell = Text(f"[{', '.join(dims)}] = {describe(tensor)[0]}")
        cell.append("\n" + weights.sources[name], style="green")
        stats = weight_stats(tensor)
        table.add_row(Text(name), cell, f"{stats['mean']:.4f}", f"{stats['std']:.4f}", f"{stats['norm']:.3f}")
    return table


def show_bert(out: Console, weights: HeadWeights, sentence: SentenceRun | None, saved: Path | None) -> None:
    from attnscope.runs.common import Heatmap

    out.print(Text(bert_summary(weights), style="bold"))
    out.print(head_table(weights))
    if sentence is not None:
        out.print(Text(f"this head on {len(sentence.tokens)} tokens", style="bold"))
        out.print(steps_table(sentence.trace.steps))
        for note in sentence.trace.notes:
            out.print(Text(f"note: {note}", style="yellow"))
        labels = list(sentence.tokens)
        show_heatmap(out, Heatmap(f"layer {weights.layer}, head {weights.head}: attention",
                                  sentence.trace["attention"].tolist(), labels, labels))
    if saved:
        count = len(weights.tensors) + (1 if sentence is not None else 0)
        out.print(Text(f"saved {count} tensors to {saved}"))


def bert_json(model: str, text: str | None, weights: HeadWeights, sentence: SentenceRun | None,
              saved: Path | None) -> dict[str, Any]:
    from attnscope.models.checkpoint import describe, weight_stats

    info = weights.info
    tensors = []
    for name, tensor in weights.tensors.items():
        shape, dtype, nbytes = describe(tensor)
        tensors.append({"name": name, "shape": shape, "dims": list(BERT_DIMS[name]), "dtype": dtype,
                        "bytes": nbytes, "op": weights.sources[name],
                        "source": weights.sources[name], "stats": weight_stats(tensor)})
    payload: dict[str, Any] = {
        "command": "bert",
        "params": {"model": model, "layer": weights.layer, "head": weights.head, "text": text},
        "model": {"architecture": info.architecture, "path": str(info.folder), "layers": info.n_layer,
                  "heads": info.n_head, "d_model": info.d_model, "d_head": info.d_head},
        "tensors": tensors,
    }
    if sentence is not None:
        payload["tokens"] = sentence.tokens
        payload["attention"] = clean(sentence.trace["attention"].tolist())
        payload["steps"] = [step_json(step) for step in sentence.trace.steps]
    if saved:
        payload["saved"] = str(saved)
    return payload
