"""How attnscope's results show themselves in Jupyter (`_repr_html_`): a trace as an HTML table of its steps
with its attention as an inline SVG heatmap; a model head's run with its layer's steps, the head's pattern on
the text and every head of the layer with what it does; a pattern alone as a heatmap. Plain HTML and SVG with
inline styles: no script, font or style fetched from anywhere, so a notebook saved with them stays readable
offline. Colours are viridis (attnscope/views/colors.py); large patterns are pooled as the terminal pools them
(attnscope/views/pooling.py).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from attnscope.cost import format_bytes, format_flops
from attnscope.views.colors import hex_color
from attnscope.words import counted

if TYPE_CHECKING:
    from torch import Tensor


class LayerHeads(Protocol):
    """Every head of a layer as readings/headstats.py's `LayerHeads` holds it, taken by its interface: trace.py
    and headstats.py call this module from their _repr_html_, and importing them back would make a loop."""

    title: str
    attention: Tensor  # [n_head, n_Q, n_K]
    heads: list[dict[str, Any]]  # {"head", "stats", "kind"} each, and "grid_stats" on an image's patch grid

    def columns(self) -> list[tuple[str, str, str, str]]: ...  # (title, entry, key, format) after head and kind

CELL = 14  # pixels per heatmap cell
MAX_CELLS = 96  # rows and columns drawn inline; beyond, neighbouring queries and keys are pooled
THUMB_CELLS = 32  # rows and columns of one head's small heatmap in the all-heads grid
THUMB_PIXELS = 128  # the most pixels a side of one head's small heatmap takes
FONT = "font-family='monospace' font-size='10'"
# Jupyter's stylesheet right-aligns every table cell: each cell says its alignment (text left, numbers right).
LEFT, RIGHT = " style='text-align:left'", " style='text-align:right'"
# Cells on pixel edges, not anti-aliased: without it, at a fractional zoom the background shows as thin dark
# seams between rows of cells.
CRISP = "shape-rendering='crispEdges'"


def trace_html(trace: Any, pattern: bool = True) -> str:
    """A `Trace` (taken by its interface, so trace.py can call this without an import loop) as an HTML table
    of its steps, and with `pattern` its attention (index 0 of every leading axis) as a heatmap."""
    rows = []
    for step in trace.steps:
        size = format_bytes(step.nbytes) if step.allocates else "view"
        flops = format_flops(step.flops) if step.flops else "-"
        rows.append(
            f"<tr><td{LEFT}><b>{html.escape(step.name)}</b></td><td{LEFT}><code>{html.escape(step.dims_text())}</code>"
            f"<br><code style='color:#2a7'>{html.escape(step.op)}</code></td><td{LEFT}>{html.escape(step.dtype)}</td>"
            f"<td{RIGHT}>{size}</td><td{RIGHT}>{flops}</td></tr>")
    notes = "".join(f"<p><i>note: {html.escape(note)}</i></p>" for note in trace.notes)
    table = (f"<table><thead><tr><th{LEFT}>step</th><th{LEFT}>dims = shape / op</th><th{LEFT}>dtype</th>"
             f"<th{RIGHT}>size</th><th{RIGHT}>FLOPs</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
             f"<p>total {format_flops(trace.total_flops)}</p>{notes}")
    # a softmax pattern, or a linear attention layer's exact matrix (linear_attention.py)
    name = next((n for n in ("attention", "effective_attention") if n in trace), None)
    if pattern and name is not None and trace[name].device.type != "meta" and trace[name].dim() >= 2:
        attention = trace[name]
        while attention.dim() > 2:
            attention = attention[0]
        where = "" if trace[name].dim() == 2 else " (index 0 of every leading axis)"
        table += pattern_svg(attention, title=f"{name}{where}")
    return table


def pattern_svg(matrix: Any, row_labels: Sequence[str] | None = None, col_labels: Sequence[str] | None = None,
                title: str = "attention") -> str:
    """An [n_Q, n_K] pattern (a tensor or nested lists) as SVG cells on the viridis scale, 0 to the pattern's
    maximum; rows = queries. Beyond MAX_CELLS a side is pooled (keys summed, queries averaged) and says so."""
    import torch

    from attnscope.views.pooling import group_size, pool

    A = torch.as_tensor(matrix, dtype=torch.float64)
    n_rows, n_cols = A.shape if A.dim() == 2 else (0, 0)
    row_labels = list(row_labels or (f"q{i}" for i in range(n_rows)))
    col_labels = list(col_labels or (f"k{j}" for j in range(n_cols)))
    rows, cols = group_size(n_rows, MAX_CELLS), group_size(n_cols, MAX_CELLS)
    cells = pool(A, rows, cols).tolist() if A.numel() else []
    row_labels, col_labels = row_labels[::rows], col_labels[::cols]
    finite = [v for row in cells for v in row if math.isfinite(v)]
    peak = max(finite, default=0.0) or 1.0
    left = 8 + 7 * max((len(label) for label in row_labels), default=2)
    top = 8 + 7 * max((len(label) for label in col_labels), default=2)
    caption = f"{title}: {counted(n_rows, 'query')} x {counted(n_cols, 'key')}, 0 (dark) to {peak:.3g} (bright)"
    width = max(left + len(col_labels) * CELL + 4, 6 * len(caption) + 8)
    height = top + len(row_labels) * CELL + 22
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' {FONT} {CRISP}>",
             f"<text x='2' y='{height - 6}'>{html.escape(caption)}</text>"]
    for j, label in enumerate(col_labels):
        x = left + j * CELL + CELL // 2 + 3
        parts.append(f"<text transform='translate({x},{top - 4}) rotate(-90)'>{html.escape(label)}</text>")
    for i, row in enumerate(cells):
        y = top + i * CELL
        parts.append(f"<text x='2' y='{y + CELL - 3}'>{html.escape(row_labels[i])}</text>")
        for j, value in enumerate(row):
            color = hex_color(value / peak) if math.isfinite(value) else "#ffffff"
            parts.append(f"<rect x='{left + j * CELL}' y='{y}' width='{CELL}' height='{CELL}' fill='{color}'>"
                         f"<title>{html.escape(row_labels[i])} → {html.escape(col_labels[j])}: {value:.4f}</title>"
                         "</rect>")
    parts.append("</svg>")
    pooled = f"<p>each cell = sum over {cols} keys, mean over {rows} queries</p>" if rows > 1 or cols > 1 else ""
    return "".join(parts) + pooled


def heads_html(heads: LayerHeads) -> str:
    """Every head as a small heatmap (each row on its own scale, as the terminal draws them) titled with its
    index and kind, then a table of each head's statistics (attnscope/readings/headstats.py)."""
    from attnscope.views.pooling import group_size, pool

    n_head, n_Q, n_K = heads.attention.shape
    sizes = f"{counted(n_head, 'head')}, {counted(n_Q, 'query')} x {counted(n_K, 'key')}"
    title = f"<p><b>{html.escape(heads.title)}: every head</b> [{sizes}]</p>"
    if not (n_head and n_Q and n_K):
        return title + "<p>nothing to draw</p>"
    rows, cols = group_size(n_Q, THUMB_CELLS), group_size(n_K, THUMB_CELLS)
    pooled = pool(heads.attention, rows, cols).tolist()
    px = max(2, min(8, THUMB_PIXELS // max(len(pooled[0]), len(pooled[0][0]))))  # pixels per cell
    figures = []
    for h, cells in enumerate(pooled):
        width, height = len(cells[0]) * px, len(cells) * px
        rects = []
        for i, row in enumerate(cells):
            peak = max((v for v in row if math.isfinite(v)), default=0.0) or 1.0
            for j, value in enumerate(row):
                color = hex_color(value / peak) if math.isfinite(value) else "#ffffff"
                rects.append(f"<rect x='{j * px}' y='{i * px}' width='{px}' height='{px}' fill='{color}'/>")
        figures.append(f"<figure style='margin:4px'><figcaption><b>{h}</b>: {html.escape(heads.heads[h]['kind'])}"
                       f"</figcaption><svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
                       f"{CRISP}>{''.join(rects)}</svg></figure>")
    pooled_note = f"; each cell = sum over {cols} keys, mean over {rows} queries" if rows > 1 or cols > 1 else ""
    legend = (f"<p>rows = queries, columns = keys; each row on its own scale, dark (0) to bright (its largest "
              f"cell){pooled_note}</p>")
    grid = f"<div style='display:flex;flex-wrap:wrap'>{''.join(figures)}</div>"
    return title + legend + grid + heads_table_html(heads)


def heads_table_html(heads: LayerHeads) -> str:
    """A row per head, the columns the terminal's table has (readings/headstats.py's `LayerHeads.columns`: on a
    vision tower's patch grid, the grid's figures)."""
    shown = heads.columns()
    titles = ["head", "kind", *("entropy (bits)" if title == "entropy" else title for title, *_ in shown)]
    header = "".join(f"<th{LEFT if name == 'kind' else RIGHT}>{html.escape(name)}</th>" for name in titles)
    body = []
    for head in heads.heads:
        numbers = "".join(f"<td{RIGHT}>{'-' if head[entry][key] is None else format(head[entry][key], spec)}</td>"
                          for _, entry, key, spec in shown)
        body.append(f"<tr><td{RIGHT}>{head['head']}</td><td{LEFT}>{html.escape(head['kind'])}</td>{numbers}</tr>")
    return f"<table><thead><tr>{header}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def head_html(result: Any) -> str:
    """A model head's run (runs/head.py's HeadResult, taken by its interface): which head of which model, the
    layer's steps, this head's pattern on the text, and every head of the layer."""
    i, o = result.info, result.options
    parts = [f"<p><b>{html.escape(i.architecture)}: layer {o.layer}, head {o.head}</b><br>"
             f"{counted(i.layers, 'layer')}, {counted(i.heads, 'head')}, d_model {i.d_model}<br>"
             f"<code>{html.escape(str(i.path))}</code></p>"]
    if result.weights is not None:
        parts.append("<p>weights: " + ", ".join(f"<code>{html.escape(name)}</code> = "
                                                f"<code>{html.escape(source)}</code>"
                                                for name, source in result.weights.sources.items()) + "</p>")
    if result.run is not None:
        parts.append(trace_html(result.run.layer, pattern=False))
    parts.extend(f"<p><i>note: {html.escape(note)}</i></p>" for note in result.notes
                 if result.run is None or note not in result.run.layer.notes)
    if result.attention is not None and result.encoded is not None:
        tokens = result.encoded.labels
        parts.append(pattern_svg(result.attention, tokens, tokens, f"layer {o.layer}, head {o.head}"))
    if result.heads is not None:
        parts.append(heads_html(result.heads))
    return "".join(parts)
