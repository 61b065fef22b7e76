"""The attention pattern as shaded cells that read without colour, fitted to the terminal's width.

Rows are queries, columns keys. A column is two cells wide when there is room, one when not; when even
one cell per key does not fit, neighbouring keys are pooled (a column shows their summed weight) and the
title says so. Key labels are written downwards above their columns; when a label has a character wider
than its column (CJK at one cell a column), the columns are numbered instead, with a key underneath.
Widths are display widths (rich.cells), so CJK labels line up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len, set_cell_size
from rich.console import Console
from rich.text import Text

from attnscope.render.fit import FittedText

if TYPE_CHECKING:
    from attnscope.runs.common import Heatmap

SHADES = " ░▒▓█"  # five levels, from no weight to the most shown; they read without colour (NO_COLOR, pipes)
NOT_FINITE = "?"  # a NaN (or infinite) weight: not a shade, and left out of the shading's scale
ROW_LIMIT = 64  # query rows drawn; --save or --json hold the rest
ROW_LABEL_WIDTH = 14  # cells for a query's label
BEST_LABEL_WIDTH = 12  # cells for the key a row attends to most


@dataclass
class Grid:
    """What is drawn: the rows shown, the key columns after pooling, their labels, and the cell width."""

    rows: list[list[float]]
    cols: list[str]
    pool: int  # keys summed into one column
    cell: int  # character cells per column
    numbered: bool  # column labels are numbers, with a key underneath


def heatmap_json(hm: Heatmap) -> dict[str, Any]:
    return {"title": hm.title, "rows": hm.row_labels, "cols": hm.col_labels, "matrix": hm.matrix}


def show_heatmap(out: Console, hm: Heatmap) -> None:
    """The pattern, rows = queries, columns = keys, and for each row the key it attends to most and the
    row's entropy H (0 = all on one key, ln n_K = spread evenly). A NaN weight is drawn as `?`."""
    n_rows, n_cols = len(hm.row_labels), len(hm.col_labels)
    if not hm.matrix or not hm.matrix[0]:
        out.print(Text(f"{hm.title}  [{n_rows} queries x {n_cols} keys]: nothing to draw", style="bold"))
        return
    shown = hm.matrix[:ROW_LIMIT]
    row_w = min(max((cell_len(s) for s in hm.row_labels[:ROW_LIMIT]), default=1), ROW_LABEL_WIDTH)
    summaries = [_summary(values, hm.col_labels) for values in shown]
    room = out.width - row_w - 1 - max((cell_len(s) for s in summaries), default=0)
    grid = _grid(shown, hm.col_labels, room)
    largest = max((v for r in grid.rows for v in r if math.isfinite(v)), default=None)
    peak = largest or 1.0

    out.print(Text(f"{hm.title}  [{n_rows} queries x {n_cols} keys]", style="bold"))
    scale = "no finite weight" if largest is None else f"weight 0 to {peak:.3f}, the most shown"
    out.print(Text(f"shades '{SHADES}': {scale} (more ink = more weight)"))
    out.print(FittedText(f"→ most-attended key;  H = row entropy, nats (0: one key, ln {n_cols} = "
                         f"{math.log(max(n_cols, 1)):.2f}: uniform)"))
    if grid.pool > 1:
        out.print(FittedText(f"keys pooled {grid.pool} to a column to fit {out.width} columns: a column is their "
                             "summed weight"))
    for line in _column_labels(grid):
        out.print(Text(" " * (row_w + 1) + line.rstrip()))
    for label, values, summary in zip(hm.row_labels, grid.rows, summaries, strict=False):
        label = _fit_label(label, row_w)
        text = Text(" " * (row_w - cell_len(label)) + label + " ")
        for value in values:
            if math.isfinite(value):
                text.append(SHADES[_level(value, peak)] * grid.cell, style=_heat_style(value / peak))
            else:
                text.append(NOT_FINITE * grid.cell)
        text.append(summary)
        out.print(text)
    if grid.numbered:
        out.print(FittedText("keys: " + "  ".join(f"{i * grid.pool}={label}" for i, label in enumerate(grid.cols))))
    if not all(math.isfinite(v) for r in grid.rows for v in r):
        out.print(Text(f"{NOT_FINITE} = NaN: the attention holds NaN there (--stats counts them in every step)"))
    if len(shown) < n_rows:
        out.print(Text(f"(showing the first {len(shown)} of {n_rows} queries; --save or --json hold them all)"))


def _grid(rows: list[list[float]], labels: list[str], room: int) -> Grid:
    n_cols = len(labels)
    room = max(room, 1)
    pool = max(1, math.ceil(n_cols / room))
    if pool > 1:
        rows = [[sum(r[j : j + pool]) for j in range(0, n_cols, pool)] for r in rows]
        labels = labels[::pool]
    cell = 2 if 2 * len(labels) <= room else 1
    numbered = any(cell_len(char) > cell for label in labels for char in label)
    return Grid(rows, labels, pool, cell, numbered)


def _column_labels(grid: Grid) -> list[str]:
    """Labels (or column numbers) written top to bottom, one character per line, `cell` wide each."""
    labels = [str(i * grid.pool) for i in range(len(grid.cols))] if grid.numbered else [s[:10] for s in grid.cols]
    depth = max((len(s) for s in labels), default=0)
    return ["".join(set_cell_size(s[line] if line < len(s) else " ", grid.cell) for s in labels)
            for line in range(depth)]


def _summary(values: list[float], labels: list[str]) -> str:
    if not all(math.isfinite(v) for v in values):
        return "  → NaN in this row"
    best = max(range(len(values)), key=values.__getitem__) if values else 0
    entropy = max(0.0, -sum(p * math.log(p) for p in values if p > 0))
    weight = values[best] if values else 0.0
    return f"  → {_fit_label(labels[best] if labels else '', BEST_LABEL_WIDTH)} {weight:.2f}  H={entropy:.2f}"


def _fit_label(label: str, width: int) -> str:
    return label if cell_len(label) <= width else set_cell_size(label, width)


def _level(value: float, peak: float) -> int:
    return min(len(SHADES) - 1, int(round(value / peak * (len(SHADES) - 1))))


def _heat_style(fraction: float) -> str:
    # A blue-to-red ramp on top of the shade characters; without colour the characters alone carry it.
    red, blue = int(60 + 195 * fraction), int(200 - 160 * fraction)
    return f"rgb({red},60,{blue})"
