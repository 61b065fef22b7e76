"""`--all-heads`: every head of a layer as a grid of small heatmaps, each with its index and kind, and a table
with a row per head (attnscope/readings/headstats.py: entropy, first-token "sink", previous, self, distance, kind;
on a vision tower's patch grid, readings/gridstats.py's figures in place of previous and distance).

A small heatmap has at most THUMB_COLS key columns and THUMB_ROWS query rows; beyond that neighbouring keys
are summed and neighbouring queries averaged (attnscope/views/pooling.py), and the output says so. Each row is
shaded on its own scale, 0 to its largest cell: a row shows where its queries look, whatever the number of keys
they may see (in a causal head the first query's single key would otherwise outshine every other row), so a
sharp head reads as one bright cell a row and a broad one as an even band. The table gives the absolute
numbers. As many heads go on a line as fit the width.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len, set_cell_size
from rich.console import Console
from rich.text import Text

from attnscope.render.console import clean, numbers
from attnscope.render.fit import Column, FittedTable, FittedText, cell, whole
from attnscope.render.shading import MASKED_LEGEND, NOT_FINITE, CellLine, Cells, ramp
from attnscope.words import counted

if TYPE_CHECKING:
    from attnscope.readings.headstats import LayerHeads

THUMB_COLS = 22  # key columns of one head's heatmap, at most: four heads a line at 100 columns, three at 80
THUMB_ROWS = 16  # query rows, at most
BLOCK = 18  # the least width a head takes, so "11: previous-token" fits above it
GAP = 2  # cells between two heads


def show_heads(out: Console, heads: LayerHeads) -> None:
    n_head, n_Q, n_K = heads.attention.shape
    sizes = f"{counted(n_head, 'head')}, {counted(n_Q, 'query')} x {counted(n_K, 'key')}"
    out.print(Text(f"{heads.title}: every head  [{sizes}]", style="bold"))
    if getattr(heads, "effective", False):  # a linear layer's exact matrix M (linear_attention.py)
        out.print(FittedText("effective_attention: each head's exact matrix M, out = M @ V; rows need not sum to 1; "
                             "kinds and statistics read each row's share of |M| (docs/heads.md)"))
    if not (n_head and n_Q and n_K):
        out.print(Text("nothing to draw"))
        return
    from attnscope.views.pooling import group_size, pool, pool_masked

    rows, cols = group_size(n_Q, THUMB_ROWS), group_size(n_K, THUMB_COLS)
    pooled = pool(heads.attention, rows, cols).tolist()  # [n_head][n_Q / rows][n_K / cols]
    # a pooled cell is masked where the mask hid every key of every query pooled into it
    hidden = None if heads.masked is None else pool_masked(heads.masked, rows, cols).tolist()
    cell_w = 2 if cols == 1 and 2 * n_K <= THUMB_COLS else 1
    width = len(pooled[0][0]) * cell_w
    block = max(width, BLOCK)
    per_line = max(1, (out.width + GAP) // (block + GAP))
    out.print(ramp("each row on its own scale:  0", "the row's largest cell"))
    out.print(FittedText("rows = queries (the first at the top), columns = keys;  more weight: brighter in "
                         "colour, more ink in shades"))
    if rows > 1 or cols > 1:
        pooled_by = [f"sum over {cols} keys"] * (cols > 1) + [f"mean over {rows} queries"] * (rows > 1)
        out.print(FittedText(f"each cell = {', '.join(pooled_by)}, to fit"))
    for start in range(0, n_head, per_line):
        group = range(start, min(start + per_line, n_head))
        out.print()
        title = Text()
        for h in group:
            label = f"{h}: {heads.heads[h]['kind']}"
            title.append(set_cell_size(label if cell_len(label) <= block else str(h), block + GAP), style="bold")
        title.rstrip()
        out.print(title)
        for r in range(len(pooled[0])):
            pieces: list[str | Cells] = []
            for h in group:
                values = pooled[h][r]
                pieces += [Cells(values, max((v for v in values if math.isfinite(v)), default=0.0), cell_w,
                                 hidden[h][r] if hidden else None), " " * (block - width + GAP)]
            out.print(CellLine(*pieces[:-1]))
    if any(not math.isfinite(v) for head in pooled for row in head for v in row):
        out.print(Text(f"{NOT_FINITE} = NaN: the attention holds NaN there"))
    if hidden and any(any(row) for head in hidden for row in head):
        out.print(FittedText(MASKED_LEGEND))
    out.print(heads_table(heads))
    entropy = "entropy: mean over queries, bits (log2 n = even over n keys)"
    if heads.grid is not None and heads.grid.tower:  # an image's patches: figures on the grid (gridstats.py)
        special = [name for name, tokens in (("[CLS]", heads.grid.cls), ("[DIST]", heads.grid.distillation),
                                             ("registers", heads.grid.registers)) if tokens]
        out.print(FittedText(f"{entropy};  " + "".join(f"{name}, " for name in special) + "self, row, column, "
                             "8 nbrs: mean over patch queries of the weight on " +
                             "".join(f"{name}, " for name in special) + "its own patch, the rest of its row, of "
                             "its column, its 8 neighbours;  distance: mean distance on the grid, in patches, of "
                             "the weight on patches (docs/heads.md)"))
        return
    from attnscope.render.readings import audio_words

    image = ";  image: the text's weight on the image's tokens, mean over the text after it" if heads.grid else ""
    audio = audio_words(heads.col_labels)  # Whisper's encoder positions: its first 20 ms, not a token
    first = "first token" if audio is None else audio.replace("the audio's", "first: the audio's")
    out.print(FittedText(f"{entropy};  {first} (the \"sink\"), previous, self: mean weight there;  distance: "
                         f"mean attended distance, in positions{image} (docs/heads.md)"))


def heads_table(heads: LayerHeads) -> FittedTable:
    """A row per head: its kind and statistics; on a vision tower's patch grid the grid's figures in place of
    the previous token and the distance in positions (readings/gridstats.py); a VLM's text gains its share on
    the image (LayerHeads.columns)."""
    shown = heads.columns()
    columns = [Column("head", "right", style="bold cyan"), Column("kind"),
               *(Column(title, "right") for title, *_ in shown)]
    rows = [[cell(whole(str(head["head"]))), cell(whole(_kinds(head))),
             *(cell(whole(_number(head[entry][key], spec))) for _, entry, key, spec in shown)]
            for head in heads.heads]
    return FittedTable(columns, rows)


def _kinds(head: dict[str, Any]) -> str:
    """The head's kind, and its second where it has one (`first-token + induction`)."""
    also = head.get("kind_also")
    return head["kind"] if also is None else f"{head['kind']} + {also}"


def _number(value: float | None, spec: str) -> str:
    """A figure to its digits; `nan` where it is not finite, `-` where it does not apply (None)."""
    if value is None:
        return "-"
    return format(value, spec) if math.isfinite(value) else "nan"


def heads_json(heads: LayerHeads) -> list[dict[str, Any]]:
    """`[{"head", "attention", "stats", "kind", "sinks_share"}]`, `"value_norms", "weighted", "moved"` where the
    values are known, `"grid_stats"` where the tokens are an image's patch grid (a vision tower; a VLM's prompt),
    and `"batch"` where the heads are one batch element's."""
    from attnscope.render.readings import head_readings

    out = []  # a model's heads (no batch element) gain the readings; sdpa's and mha's keep their keys
    extra = head_readings(heads) if heads.batch is None else [{} for _ in heads.heads]
    for h, (head, readings) in enumerate(zip(heads.heads, extra, strict=True)):
        entry: dict[str, Any] = {"head": head["head"]}
        if heads.batch is not None:
            entry["batch"] = heads.batch
        entry |= {"attention": numbers(heads.attention[h]), "stats": clean(head["stats"]),
                  "kind": head["kind"], "kind_also": head.get("kind_also")} \
            | readings  # value_norms, weighted, moved, sinks_share (render/readings.py)
        if "grid_stats" in head:  # an image's patch grid (readings/gridstats.py): null where a figure has no rows
            entry["grid_stats"] = clean(head["grid_stats"])
        out.append(entry)
    return out
