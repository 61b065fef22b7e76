"""Beyond one layer: every layer's heads at a glance (`--all-layers`), the decode timeline (`--generate`), and a
long input's pooled pattern; and their JSON (docs/json.md).

Every layer: a table of kinds, a letter per head and a line per layer (readings/headstats.py's kinds), then the
layers as rows of small heatmaps, each head pooled to THUMB_COLS keys x THUMB_ROWS queries and shaded row by row
as `--all-heads` shades them. The decode timeline: a line per new token, its position, its text and the row of
layer L's head that chose it, keys pooled to fit; keys a sliding window has let go are drawn as `×`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len, set_cell_size
from rich.console import Console
from rich.text import Text

from attnscope.errors import printable
from attnscope.models.tokenizer import token_label
from attnscope.readings.headstats import TEXT_ONLY
from attnscope.render.console import clean, numbers
from attnscope.render.fit import FittedText
from attnscope.render.shading import MASKED_LEGEND, CellLine, Cells, ramp
from attnscope.views.explorer import KIND_LETTERS as LETTERS  # the page's grid uses the same letters
from attnscope.views.pooling import THUMB_COLS, THUMB_ROWS  # the grid's cells, which a streamed run pools to
from attnscope.words import counted

if TYPE_CHECKING:
    import torch

    from attnscope.readings.headstats import LayerHeads
    from attnscope.runs.head_result import HeadResult

EVICTED = "×"
RULER_WORDS = "  (key position)"  # after the decode timeline's key_ruler
LABEL = 9  # "layer 23 " and the like


def show_layers(out: Console, layers: list[LayerHeads], n_tokens: int) -> None:
    n_head = max((layer.attention.shape[0] for layer in layers), default=0)  # a linear layer may have more
    tower = bool(layers) and layers[0].grid is not None and layers[0].grid.tower  # an image's patches: no text kinds
    unit = "image tokens" if tower else "tokens"
    out.print(Text(f"every layer, every head  [{len(layers)} layers x {n_head} heads, {n_tokens} {unit}]",
                   style="bold"))
    kinds = [(name, letter) for name, letter in LETTERS.items() if not tower or name not in TEXT_ONLY]
    out.print(FittedText("kinds: " + "  ".join(f"{letter} {name}" for name, letter in kinds) + "  (docs/heads.md)"))
    per_line = max(1, (out.width - LABEL) // 2)
    for start in range(0, n_head, per_line):
        heads = range(start, min(start + per_line, n_head))
        out.print(Text(" " * LABEL + "".join(f"{h % 10:<2}" for h in heads).rstrip(), style="dim"))
        for layer in layers:  # titled with the model's own numbers (a hybrid's attention layers skip the others)
            letters = "".join(f"{LETTERS.get(layer.heads[h]['kind'], '?') if h < len(layer.heads) else ' ':<2}"
                              for h in heads).rstrip()
            out.print(Text(layer.title.ljust(LABEL) + letters))
    both = [f"{layer.title.removeprefix('layer ')}.{head['head']} {LETTERS.get(head['kind'], '?')}+"
            f"{LETTERS.get(head['kind_also'], '?')}" for layer in layers for head in layer.heads
            if head.get("kind_also")]
    if both:  # a head can be both (readings/headstats.kind_also): its second kind, by layer.head
        out.print(FittedText("two kinds (layer.head, first + second): " + ",  ".join(both)))
    if any(layer.effective for layer in layers):
        out.print(FittedText("layers " + ", ".join(layer.title.removeprefix("layer ") for layer in layers
                                                   if layer.effective)
                             + ": linear attention, each head's exact matrix effective_attention (rows need not sum "
                             "to 1; kinds read each row's share of |M|)"))
    _thumbnails(out, layers)


def _thumbnails(out: Console, layers: list[LayerHeads]) -> None:
    """The layers as rows of small heatmaps, each row of cells on its own scale. A layer read as it came (a long
    text: readings/layerdigest.py) holds its thumbnails already, pooled to the same cells."""
    from attnscope.readings.layerdigest import StreamedHeads
    from attnscope.views.pooling import group_size, pool, pool_masked

    if not layers or 0 in layers[0].attention.shape:
        return
    _, n_Q, n_K = layers[0].attention.shape
    rows, cols = group_size(n_Q, THUMB_ROWS), group_size(n_K, THUMB_COLS)
    width = math.ceil(n_K / cols)
    per_line = max(1, (out.width - LABEL) // (width + 1))
    out.print()
    out.print(ramp("each row on its own scale:  0", "the row's largest cell"))
    out.print(FittedText(f"each head: rows = queries, columns = keys, each cell the sum over {cols} keys and the "
                         f"mean over {rows} queries"))
    for layer in layers:
        n_head = layer.attention.shape[0]  # the layer's own: a hybrid's linear layers may have more heads
        kept = layer.thumbnail if isinstance(layer, StreamedHeads) else None
        pooled = (kept if kept is not None else pool(layer.attention, rows, cols)).tolist()  # [n_head][rows][cols]
        hidden = None if layer.masked is None else pool_masked(layer.masked, rows, cols).tolist()
        for start in range(0, n_head, per_line):
            heads = range(start, min(start + per_line, n_head))
            for r in range(len(pooled[0])):
                label = layer.title if r == 0 and start == 0 else f"  h{start}" if r == 0 else ""
                pieces: list[str | Cells] = [label.ljust(LABEL)]
                for h in heads:
                    values = pooled[h][r]
                    peak = max((v for v in values if math.isfinite(v)), default=0.0)
                    pieces += [Cells(values, peak, 1, hidden[h][r] if hidden else None), " "]
                out.print(CellLine(*pieces[:-1]))
    if any(layer.masked is not None and bool(layer.masked.any()) for layer in layers):
        out.print(FittedText(f"{MASKED_LEGEND}; marked in the traced layer, whose steps are kept"))


def show_decode(out: Console, result: HeadResult) -> None:
    """A line per new token: its position, its text, and the row of layer L's head that chose it."""
    from attnscope.views.pooling import group_size, pool

    steps, o = result.decode or [], result.options
    if not steps:
        return
    n_K = steps[-1].attention.shape[-1]
    texts = [token_label(token, text) for token, text in result.decode_pieces]  # as the heatmap's labels
    text_w = min(12, max((cell_len(t) for t in texts), default=4))
    pos_w = len(str(steps[-1].position))
    cols = group_size(n_K, max(8, out.width - pos_w - text_w - 4))
    out.print(Text(f"generated {counted(len(steps), 'token')} greedily: each row is layer {o.layer}, head {o.head}'s "
                   f"attention from the token before, which chose it", style="bold"))
    out.print(ramp("scale  0", "each row's largest weight"))
    if cols > 1:
        out.print(FittedText(f"each column = sum over {cols} keys to fit {out.width} columns"))
    if any(step.evicted for step in steps):
        out.print(FittedText(f"{EVICTED} = a key outside this layer's sliding window: the cache has let it go"))
    out.print(Text(" " * (pos_w + text_w + 2) + key_ruler(math.ceil(n_K / cols), cols, out.width - pos_w - text_w - 2)
                   + RULER_WORDS, style="dim"))
    for step, text in zip(steps, texts, strict=False):
        row = step.attention[o.head : o.head + 1]  # [1, n_K]
        values = pool(row[None], 1, cols)[0, 0].tolist()
        gone = step.evicted // cols  # whole columns of evicted keys
        pad = math.ceil(n_K / cols) - len(values)
        peak = max((v for v in values if math.isfinite(v)), default=0.0)
        label = f"{step.position:>{pos_w}} " + set_cell_size(text, text_w) + " "
        out.print(CellLine(label, EVICTED * gone, Cells(values[gone:], peak), " " * pad))
    total = steps[-1].kv_cache_bytes
    from attnscope.cost import format_bytes

    out.print(Text(f"KV cache after the last token: {format_bytes(total)} (every layer's keys and values, as "
                   "transformers' cache holds them)"))
    if result.generated_text is not None:  # the new tokens decoded together, as tokenizer.decode(ids) reads them
        out.print(Text("the continuation: ", style="bold") + Text(printable(result.generated_text)))


def key_ruler(n_cols: int, pool: int, room: int) -> str:
    """The keys' positions above columns one cell wide (each `pool` keys): a number every 10 columns, where it
    fits before the next and within `room` (less the words that follow it)."""
    line = ""
    for c in range(0, n_cols, 10):
        number = str(c * pool)
        if (not line or len(line) < c) and c + len(number) <= room - len(RULER_WORDS):
            line = line.ljust(c) + number
    return line


def layers_json(layers: list[LayerHeads], layer_numbers: list[int] | None = None,
                selected: list[torch.Tensor | None] | None = None) -> list[dict[str, Any]]:
    """`all_layers`: a layer each, `{"layer", "attention" [n_head, n_Q, n_K], "kinds", "stats", "sinks_share"}`
    (and `"value_norms" [n_head, n_K], "moved" [n_head]` where the values are known, `"selected" [n_Q][n_K]` on
    a sparse indexer's layer), "layer" the model's own number (`layer_numbers`: a hybrid's attention layers; by
    default 0, 1, ...)."""
    from attnscope.render.readings import layer_readings

    numbers_of = layer_numbers or list(range(len(layers)))
    chosen = selected or [None] * len(layers)
    return [{"layer": i, "attention": numbers(layer.attention),
             "pattern": "effective_attention" if layer.effective else "attention",  # a linear layer's exact M
             "kinds": [head["kind"] for head in layer.heads],
             "kinds_also": [head.get("kind_also") for head in layer.heads],
             "stats": [clean(head["stats"]) for head in layer.heads]}
            | ({"grid_stats": [clean(head["grid_stats"]) for head in layer.heads]} if layer.grid else {})  # an image
            | layer_readings(layer)  # value_norms, moved, sinks_share (render/readings.py)
            | ({"selected": kept.tolist()} if kept is not None else {})  # the sparse indexer's choice
            for i, layer, kept in zip(numbers_of, layers, chosen, strict=True)]


def decode_json(result: HeadResult) -> list[dict[str, Any]]:
    """`decode_steps`: a new token each, `{"token_id", "token", "text", "position", "attention" [n_head, n_K],
    "evicted", "kv_cache_bytes"}`."""
    return [{"token_id": step.token_id, "token": token, "text": text, "position": step.position,
             "attention": numbers(step.attention), "evicted": step.evicted,
             "kv_cache_bytes": step.kv_cache_bytes}
            for step, (token, text) in zip(result.decode or [], result.decode_pieces, strict=False)]
