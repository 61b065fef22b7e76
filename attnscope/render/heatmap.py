"""The attention pattern as shaded cells that read without colour."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

if TYPE_CHECKING:
    from attnscope.runs.common import Heatmap

SHADES = " ░▒▓█"  # five levels that read without colour (NO_COLOR, pipes)
NOT_FINITE = "?"  # a NaN weight: not a shade
HEATMAP_LIMIT = 64  # rows and columns drawn; larger patterns show their top-left corner


def heatmap_json(hm: Heatmap) -> dict[str, Any]:
    return {"title": hm.title, "rows": hm.row_labels, "cols": hm.col_labels, "matrix": hm.matrix}


def show_heatmap(out: Console, hm: Heatmap) -> None:
    """The pattern as shaded cells, rows = queries, columns = keys (labels read downwards), and for each
    row the key it attends to most and the row's entropy (0 = all on one key, ln n_K = uniform). A NaN
    (or infinite) weight is drawn as `?` and left out of the shading's scale."""
    import math

    n_rows, n_cols = len(hm.row_labels), len(hm.col_labels)
    if not hm.matrix or not hm.matrix[0]:
        out.print(Text(f"{hm.title}  [{n_rows} queries x {n_cols} keys]: nothing to draw", style="bold"))
        return
    rows, cols = min(n_rows, HEATMAP_LIMIT), min(n_cols, HEATMAP_LIMIT)
    shown = [v for r in hm.matrix[:rows] for v in r[:cols]]
    largest = max((v for v in shown if math.isfinite(v)), default=None)
    peak = largest or 1.0
    cell = 2 if cols <= 40 else 1
    row_w = min(max((len(s) for s in hm.row_labels[:rows]), default=1), 14)
    col_labels = [label[:10] for label in hm.col_labels[:cols]]

    out.print(Text(f"{hm.title}  [{n_rows} queries x {n_cols} keys]  (darker = more; "
                   f"{'no finite weight' if largest is None else f'max {peak:.3f}'})",
                   style="bold"))
    depth = max((len(s) for s in col_labels), default=0)
    for line in range(depth):  # column labels, written top to bottom
        chars = "".join((label[line] if line < len(label) else " ").ljust(cell) for label in col_labels)
        out.print(Text(" " * (row_w + 1) + chars.rstrip()))
    for i in range(rows):
        values = hm.matrix[i]
        text = Text(hm.row_labels[i][:row_w].rjust(row_w) + " ")
        for value in values[:cols]:
            if not math.isfinite(value):
                text.append(NOT_FINITE * cell)
                continue
            level = min(len(SHADES) - 1, int(round(value / peak * (len(SHADES) - 1))))
            text.append(SHADES[level] * cell, style=_heat_style(value / peak))
        if all(math.isfinite(v) for v in values):
            best = max(range(n_cols), key=values.__getitem__)
            entropy = max(0.0, -sum(p * math.log(p) for p in values if p > 0))
            text.append(f"  → {hm.col_labels[best][:12]} {values[best]:.2f}  H={entropy:.2f}")
        else:
            text.append("  → NaN in this row")
        out.print(text)
    if not all(math.isfinite(v) for v in shown):
        out.print(Text(f"{NOT_FINITE} = NaN: the attention holds NaN there (--stats counts them in every step)"))
    if rows < n_rows or cols < n_cols:
        out.print(Text(f"(showing the first {rows} x {cols}; --save or --json hold the whole pattern)"))


def _heat_style(fraction: float) -> str:
    # A blue-to-red ramp on top of the shade characters; without colour the characters alone carry it.
    red, blue = int(60 + 195 * fraction), int(200 - 160 * fraction)
    return f"rgb({red},60,{blue})"
