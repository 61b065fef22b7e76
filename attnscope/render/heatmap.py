"""The attention pattern as cells on the viridis scale, shades where there is no colour, fitted to the width.

Rows are queries, columns keys (render/shading.py says how a cell is drawn: a block of colour on a terminal
of 256 colours or more, a shade ` ░▒▓█` elsewhere). The legend gives the scale's range, 0 to the largest
weight shown. A column is two cells wide when
there is room, one when not; when even one cell per key does not fit, neighbouring keys are pooled (a column
holds their summed weight, attnscope/views/pooling.py) and the output says so. Key labels are written downwards
above their columns; when a label has a character wider than its column (CJK at one cell a column), the
columns are numbered instead, with a key underneath. Widths are display widths (rich.cells), so CJK and emoji
labels line up; control characters in a label are shown escaped (`\\n`), never printed.
"""

from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len, set_cell_size
from rich.console import Console
from rich.text import Text

from attnscope.render.fit import FittedText
from attnscope.render.shading import MASKED_LEGEND, NOT_FINITE, CellLine, Cells, ramp
from attnscope.words import counted

if TYPE_CHECKING:
    from attnscope.runs.outputs import Heatmap

ROW_LIMIT = 64  # query rows drawn; --save or --json hold the rest
ROW_LABEL_WIDTH = 14  # cells for a query's label
BEST_LABEL_WIDTH = 12  # cells for the key a row attends to most
LABEL_DEPTH = 10  # characters of a key's label written downwards
LEGEND = "more weight: brighter in colour, more ink in shades;  → most-attended key"


@dataclass
class Grid:
    """What is drawn: the rows shown, the key columns after pooling, their labels, and the cell width."""

    rows: list[list[float]]
    cols: list[str]
    pool: int  # keys summed into one column
    cell: int  # character cells per column
    numbered: bool  # column labels are numbers, with a key underneath
    masked: list[list[bool]] | None = None  # a column is masked where every key pooled into it is


def heatmap_json(hm: Heatmap) -> dict[str, Any]:
    payload = {"title": hm.title, "rows": hm.row_labels, "cols": hm.col_labels, "matrix": hm.matrix}
    if hm.masked is not None:  # [n_Q][n_K], true where the mask hid the key
        payload["masked"] = hm.masked
    return payload


def show_heatmap(out: Console, hm: Heatmap) -> None:
    """The pattern, rows = queries, columns = keys, and for each row the key it attends to most and the
    row's entropy H in bits (0 = all on one key, log2 n_K = spread evenly). A NaN weight is drawn as `?`."""
    n_rows, n_cols = len(hm.row_labels), len(hm.col_labels)
    if not hm.matrix or not hm.matrix[0]:
        out.print(Text(f"{hm.title}  [{counted(n_rows, 'query')} x {counted(n_cols, 'key')}]: nothing to draw",
                       style="bold"))
        return
    shown = hm.matrix[:ROW_LIMIT]
    row_labels = [printable(s) for s in hm.row_labels[: len(shown)]]
    col_labels = [printable(s) for s in hm.col_labels]
    row_w = min(max((cell_len(s) for s in row_labels), default=1), ROW_LABEL_WIDTH)
    summaries = [_summary(values, col_labels) for values in shown]
    room = out.width - row_w - 1 - max((cell_len(s) for s in summaries), default=0)
    grid = _grid(shown, col_labels, room, hm.masked[: len(shown)] if hm.masked else None)
    largest = max((v for r in grid.rows for v in r if math.isfinite(v)), default=None)
    peak = largest or 1.0

    out.print(Text(f"{hm.title}  [{counted(n_rows, 'query')} x {counted(n_cols, 'key')}]", style="bold"))
    if largest is None:
        out.print(Text("scale: no finite weight to shade"))
    else:
        out.print(ramp("scale  0", f"{largest:.3f}, the most shown"))
        out.print(Text(LEGEND))
    if grid.masked and any(any(row) for row in grid.masked):
        out.print(FittedText(MASKED_LEGEND))
    if grid.pool > 1:
        out.print(FittedText(f"each column = sum over {grid.pool} keys (labelled by the first) to fit "
                             f"{out.width} columns"))
    out.print(FittedText(f"H = row entropy in bits (0: one key; log2 {n_cols} = {math.log2(max(n_cols, 1)):.2f}: "
                         "uniform)"))
    for line in _column_labels(grid):
        out.print(Text(" " * (row_w + 1) + line.rstrip()))
    for i, (label, values, summary) in enumerate(zip(row_labels, grid.rows, summaries, strict=False)):
        label = _fit_label(label, row_w)
        hidden = grid.masked[i] if grid.masked else None
        out.print(CellLine(" " * (row_w - cell_len(label)) + label + " ", Cells(values, peak, grid.cell, hidden),
                           summary))
    if grid.numbered:
        out.print(FittedText("keys: " + "  ".join(f"{i * grid.pool}={label}" for i, label in enumerate(grid.cols))))
    if not all(math.isfinite(v) for r in grid.rows for v in r):
        out.print(Text(f"{NOT_FINITE} = NaN: the attention holds NaN there (--stats counts them in every step)"))
    if len(shown) < n_rows:
        out.print(Text(f"(showing the first {len(shown)} of {n_rows} queries; --save or --json hold them all)"))


def _grid(rows: list[list[float]], labels: list[str], room: int, masked: list[list[bool]] | None = None) -> Grid:
    from attnscope.views.pooling import group_size, pool, pool_masked

    n_cols = len(labels)
    room = max(room, 1)
    size = group_size(n_cols, room)
    if size > 1:
        import torch

        rows = pool(torch.tensor(rows, dtype=torch.float64), cols=size).tolist()
        labels = labels[::size]
        if masked:
            masked = pool_masked(torch.tensor(masked, dtype=torch.bool), cols=size).tolist()
    cell = 2 if 2 * len(labels) <= room else 1
    numbered = any(cell_len(char) > cell for label in labels for char in clusters(label))
    return Grid(rows, labels, size, cell, numbered, masked)


def _column_labels(grid: Grid) -> list[str]:
    """Labels (or column numbers) written top to bottom, one character per line, `cell` wide each."""
    labels = ([list(str(i * grid.pool)) for i in range(len(grid.cols))] if grid.numbered
              else [clusters(s)[:LABEL_DEPTH] for s in grid.cols])
    depth = max((len(s) for s in labels), default=0)
    return ["".join(set_cell_size(s[line] if line < len(s) else " ", grid.cell) for s in labels)
            for line in range(depth)]


def clusters(label: str) -> list[str]:
    """A label's characters as they are drawn: whole graphemes (an emoji with its skin tone, variation
    selector or joined emoji; a letter with its combining accent), so a column never shows half of one.
    Rich's own grapheme splitter where it has one (Rich 14.1 on), else each character with the zero-width
    marks that follow it."""
    try:
        from rich.cells import split_graphemes  # type: ignore[attr-defined, unused-ignore]
    except ImportError:
        out: list[str] = []
        for char in label:
            if out and cell_len(char) == 0:
                out[-1] += char
            else:
                out.append(char)
        return out
    spans, _ = split_graphemes(label)
    return [label[start:end] for start, end, _ in spans]


def printable(label: str) -> str:
    """A token as text that stays on its line: control characters and line separators escaped (`\\n`,
    `\\t`, `\\x00`); joiners and variation selectors kept, for emoji."""
    return "".join(repr(char)[1:-1] if unicodedata.category(char) in ("Cc", "Zl", "Zp") else char
                   for char in label)


def _summary(values: list[float], labels: list[str]) -> str:
    if not all(math.isfinite(v) for v in values):
        return "  → NaN in this row"
    best = max(range(len(values)), key=values.__getitem__) if values else 0
    shares = values
    if any(v < 0 for v in values) or sum(values) > 1 + 1e-2:  # a linear layer's M: each key's share of |row|
        total = sum(abs(v) for v in values) or 1.0
        shares = [abs(v) / total for v in values]
    entropy = max(0.0, -sum(p * math.log2(p) for p in shares if p > 0))
    weight = values[best] if values else 0.0
    return f"  → {_fit_label(labels[best] if labels else '', BEST_LABEL_WIDTH)} {weight:.2f}  H={entropy:.2f}"


def _fit_label(label: str, width: int) -> str:
    return label if cell_len(label) <= width else set_cell_size(label, width)
