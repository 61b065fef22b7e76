"""How attnscope's results show themselves in Jupyter: a trace as an HTML table of its steps, and an attention
pattern as an inline SVG heatmap. Plain HTML and SVG, with no script, font or style fetched from anywhere."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from attnscope.colors import hex_color
from attnscope.cost import format_bytes, format_flops

CELL = 14  # pixels per heatmap cell
MAX_CELLS = 96  # rows and columns drawn inline; a larger pattern shows its top-left corner


def trace_html(trace: Any) -> str:
    """A `Trace` (taken by its interface, so trace.py can call this without an import loop) as HTML."""
    rows = []
    for step in trace.steps:
        size = format_bytes(step.nbytes) if step.allocates else "view"
        flops = format_flops(step.flops) if step.flops else "-"
        rows.append(
            f"<tr><td><b>{html.escape(step.name)}</b></td><td><code>{html.escape(step.dims_text())}</code>"
            f"<br><code style='color:#2a7'>{html.escape(step.op)}</code></td><td>{html.escape(step.dtype)}</td>"
            f"<td style='text-align:right'>{size}</td><td style='text-align:right'>{flops}</td></tr>")
    notes = "".join(f"<p><i>note: {html.escape(note)}</i></p>" for note in trace.notes)
    table = ("<table><thead><tr><th>step</th><th>dims = shape / op</th><th>dtype</th><th>size</th>"
             f"<th>FLOPs</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
             f"<p>total {format_flops(trace.total_flops)}</p>{notes}")
    if "attention" in trace and trace["attention"].device.type != "meta" and trace["attention"].dim() >= 2:
        attention = trace["attention"]
        while attention.dim() > 2:
            attention = attention[0]
        where = "" if trace["attention"].dim() == 2 else " (index 0 of every leading axis)"
        table += pattern_svg(attention.tolist(), title=f"attention{where}")
    return table


def pattern_svg(matrix: Sequence[Sequence[float]], row_labels: Sequence[str] | None = None,
                col_labels: Sequence[str] | None = None, title: str = "attention") -> str:
    """An [n_Q, n_K] pattern as SVG cells on the viridis scale, 0 to the pattern's maximum; rows = queries."""
    n_rows, n_cols = len(matrix), len(matrix[0]) if matrix else 0
    rows, cols = min(n_rows, MAX_CELLS), min(n_cols, MAX_CELLS)
    row_labels = list(row_labels or (f"q{i}" for i in range(n_rows)))
    col_labels = list(col_labels or (f"k{j}" for j in range(n_cols)))
    finite = [v for row in matrix[:rows] for v in row[:cols] if v == v]
    peak = max(finite, default=0.0) or 1.0
    left = 8 + 7 * max((len(label) for label in row_labels[:rows]), default=2)
    top = 8 + 7 * max((len(label) for label in col_labels[:cols]), default=2)
    width, height = left + cols * CELL + 4, top + rows * CELL + 22
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
             "font-family='monospace' font-size='10'>",
             f"<text x='2' y='{height - 6}'>{html.escape(title)}: {n_rows} queries x {n_cols} keys, "
             f"0 (dark) to {peak:.3g} (bright)</text>"]
    for j, label in enumerate(col_labels[:cols]):
        x = left + j * CELL + CELL // 2 + 3
        parts.append(f"<text transform='translate({x},{top - 4}) rotate(-90)'>{html.escape(label)}</text>")
    for i in range(rows):
        y = top + i * CELL
        parts.append(f"<text x='2' y='{y + CELL - 3}'>{html.escape(row_labels[i])}</text>")
        for j in range(cols):
            value = matrix[i][j]
            color = hex_color(value / peak) if value == value else "#ffffff"
            parts.append(f"<rect x='{left + j * CELL}' y='{y}' width='{CELL}' height='{CELL}' fill='{color}'>"
                         f"<title>{html.escape(row_labels[i])} → {html.escape(col_labels[j])}: {value:.4f}</title>"
                         "</rect>")
    parts.append("</svg>")
    note = (f"<p>showing the first {rows} x {cols}</p>" if rows < n_rows or cols < n_cols else "")
    return "".join(parts) + note
