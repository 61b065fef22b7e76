"""A query's attention over the image: the patch grid drawn as cells on the terminal, and as an SVG with the
image (the processor's output, embedded as a data: URI) under the weights.

The row shown is the `[CLS]` token's where the model has one (what classifiers and DINO's attention maps read),
else every query's mean (SigLIP: how much each patch is read, on average); with --all-layers the attention
rollout's row too (readings/rollout.py). The tokens before the patches (`[CLS]`, `[DIST]`, registers) are listed
apart, with their weights: they are no place on the image. The scale runs from 0 to the largest weight on a
patch, so a register holding most of the weight does not wash the image out; the legend says so.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

from attnscope.models.tokenizer import token_label
from attnscope.render.shading import CellLine, Cells, ramp
from attnscope.views.colors import hex_color

if TYPE_CHECKING:
    import torch

    from attnscope.models.vision.patches import Picture
    from attnscope.runs.head_result import HeadResult

SVG_SIDE = 448  # the image's longer side in the SVG, in px
OPACITY = 0.6  # the weights' cells over the image


@dataclass
class Overlay:
    """One row of weights over the patches: `cells` `[rows][cols]`, the tokens before the patches with theirs,
    and what the row is (`title`)."""

    title: str
    cells: list[list[float]]
    prefix: list[tuple[str, float]]
    peak: float

    @property
    def patch_total(self) -> float:
        return sum(map(sum, self.cells))


def overlay_of(picture: Picture, row: torch.Tensor, title: str) -> Overlay:
    """`row` `[n_K]` (a query's weights over every token) laid on the picture's grid."""
    grid, first = picture.grid, picture.first
    values = [float(v) for v in row.tolist()]
    patches = values[first: first + grid.n_patches]
    cells = [patches[r * grid.cols: (r + 1) * grid.cols] for r in range(grid.rows)]
    names = picture.grid.prefix if picture.start is None else ()
    prefix = [(name, values[i]) for i, name in enumerate(names)]
    peak = max((v for v in patches if math.isfinite(v)), default=0.0)
    return Overlay(title, cells, prefix, peak)


def head_overlays(result: HeadResult) -> list[Overlay]:
    """What the image shows for this run: head h's query row ([CLS]'s; a VLM's last text query, which sees the
    image; else every query's mean), and with --all-layers the rollout's row of the same query."""
    picture, attention = result.picture, result.attention
    if picture is None or attention is None:
        return []
    where = f"{result.layer_name}, head {result.options.head}"
    tokens = getattr(result, "image_tokens", None)
    q: int | None = None
    if picture.query is not None and result.encoded is not None:  # --query
        q = picture.query
        who = f"query {q} “{result.encoded.tokens[q]}”"
    elif tokens is not None and result.encoded is not None:  # a VLM: its last text query, which sees the image
        q = len(tokens.image) - 1
        who = f"query {q} “{result.encoded.tokens[q]}”"
    elif "[CLS]" in picture.grid.prefix and picture.start is None:
        q, who = 0, "query [CLS]"
    found = [(f"{where}: {who}'s weights over the image", attention[q]) if q is not None else
             (f"{where}: every query's mean weight over the image (no [CLS])", attention.double().mean(0))]
    rollout = getattr(result, "rollout", None)
    if rollout is not None:
        found.append((f"attention rollout, layers 0..{len(result.layer_heads or []) - 1}: "
                      f"{who if q is not None else 'every query'}'s row over the image",
                      rollout[q] if q is not None else rollout.double().mean(0)))
    decoded = zip(getattr(result, "decode", None) or [], getattr(result, "decode_pieces", []), strict=False)
    for step, (token, text) in decoded:  # a VLM's --generate: each new token's row, the query's that chose it
        found.append((f"{where}: the row that chose new token {step.position} “{token_label(token, text)}”",
                      step.attention[result.options.head]))  # [n_K]
    return [overlay_of(picture, row, title) for title, row in found]


def show_overlay(out: Console, result: HeadResult) -> None:
    """Each overlay as a grid of cells, a patch a cell (two characters wide where they fit; past the width,
    blocks of patches pooled to their mean), the row and column numbers around it, the tokens before the patches
    listed apart."""
    for overlay in head_overlays(result):
        rows, cols = len(overlay.cells), len(overlay.cells[0]) if overlay.cells else 0
        width = 2 if 2 * cols + 6 <= out.width else 1
        pool = max(1, math.ceil(cols / max(1, out.width - 6)))
        cells = _pooled(overlay.cells, pool)
        peak = max((v for line in cells for v in line if math.isfinite(v)), default=0.0)
        out.print(Text(overlay.title, style="bold"))
        out.print(ramp("scale  0", f"{peak:.3g}, the largest weight on a {'patch' if pool == 1 else 'block'}"))
        out.print(Text(f"{overlay.patch_total:.3f} of the row's weight is on the {rows} x {cols} patches"
                       + (f" (drawn in blocks of {pool} x {pool} patches: their mean)" if pool > 1 else "")))
        shown = range(0, cols, pool)
        if cols > 10:  # the tens of each column number above its units
            out.print(Text("     " + "".join(f"{c // 10 if c >= 10 else ' ':<{width}}" for c in shown)))
        out.print(Text("     " + "".join(f"{c % 10:<{width}}" for c in shown)))
        for r, line in zip(range(0, rows, pool), cells, strict=True):
            out.print(CellLine(f"{r:>4} ", Cells(line, peak, width)))
        if overlay.prefix:
            out.print(Text("apart from the image: " + "  ".join(f"{name} {w:.3f}" for name, w in overlay.prefix)))


def _pooled(cells: list[list[float]], pool: int) -> list[list[float]]:
    """Blocks of `pool` x `pool` patches (fewer at the edges) as their mean."""
    if pool == 1:
        return cells
    rows, cols = len(cells), len(cells[0])
    out = []
    for r in range(0, rows, pool):
        band = cells[r:r + pool]
        out.append([sum(v for line in band for v in line[c:c + pool]) / (len(band) * len(band[0][c:c + pool]))
                    for c in range(0, cols, pool)])
    return out


def overlay_svg(result: HeadResult) -> str | None:
    """The image with head h's row (and the rollout's) on top, one panel each, in one standalone SVG: the image
    as a data: URI, a cell per patch painted on the viridis scale, its exact weight on hover (`<title>`), the
    tokens before the patches as labelled boxes beside, a colour bar with values. None without an image."""
    picture = result.picture
    overlays = head_overlays(result)
    if picture is None or not overlays:
        return None
    grid = picture.grid
    scale = SVG_SIDE / max(grid.height, grid.width)
    w, h = grid.width * scale, grid.height * scale
    panel_w, top = w + 210, 36
    parts = []
    uri = picture.data_uri()
    for k, overlay in enumerate(overlays):
        x0 = k * panel_w + 10
        parts.append(f'<g data-overlay="{k}" transform="translate({x0:.1f},0)">')
        parts.append(f'<text x="0" y="20" class="t">{html.escape(_short(overlay.title))}</text>')
        # the whole input at the patches' scale, clipped to the pixels the patches cover (a partial patch at
        # the edge is dropped by the convolution)
        parts.append(f'<clipPath id="grid-{k}"><rect x="0" y="{top}" width="{w:.1f}" height="{h:.1f}"/></clipPath>'
                     f'<image x="0" y="{top}" width="{picture.image.width * scale:.1f}" '
                     f'height="{picture.image.height * scale:.1f}" href="{uri}" preserveAspectRatio="none" '
                     f'clip-path="url(#grid-{k})"/>')
        size = grid.patch * scale
        for r, line in enumerate(overlay.cells):
            for c, value in enumerate(line):
                fraction = value / overlay.peak if overlay.peak > 0 and math.isfinite(value) else 0.0
                parts.append(f'<rect class="p" x="{c * size:.2f}" y="{top + r * size:.2f}" width="{size:.2f}" '
                             f'height="{size:.2f}" fill="{hex_color(fraction)}" '
                             f'fill-opacity="{OPACITY * fraction:.3f}"><title>p({r},{c}): {value:.4f}</title></rect>')
        parts.append(_colour_bar(w + 16, top, h, overlay.peak))
        for i, (name, value) in enumerate(overlay.prefix):
            y = top + i * 26
            fraction = min(1.0, value / overlay.peak) if overlay.peak > 0 else 0.0
            parts.append(f'<rect class="x" x="{w + 96:.1f}" y="{y}" width="20" height="20" '
                         f'fill="{hex_color(fraction)}">'
                         f'<title>{html.escape(name)}: {value:.4f}</title></rect>'
                         f'<text x="{w + 122:.1f}" y="{y + 15}" class="s">{html.escape(name)} {value:.3f}</text>')
        parts.append("</g>")
    total_w, total_h = panel_w * len(overlays) + 10, top + h + 56
    notes = (f"{html.escape(picture.path)}: {grid.rows} x {grid.cols} patches of {grid.patch} px "
             f"({html.escape(picture.processor)})", "colour: the weight, from 0 to the largest on a patch; hover a "
             "cell for its value")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w:.0f}" height="{total_h:.0f}" '
            f'viewBox="0 0 {total_w:.0f} {total_h:.0f}" font-family="DejaVu Sans, Arial, sans-serif">'
            '<style>.t{font-size:13px;font-weight:bold;fill:#222}.s{font-size:12px;fill:#222}'
            '.p{stroke:#000;stroke-opacity:.15;stroke-width:.5}</style>'
            f'<rect width="100%" height="100%" fill="#fff"/>{"".join(parts)}'
            f'<text x="10" y="{top + h + 22:.1f}" class="s">{notes[0]}</text>'
            f'<text x="10" y="{top + h + 40:.1f}" class="s">{notes[1]}</text></svg>')


def _colour_bar(x: float, top: float, height: float, peak: float) -> str:
    steps = 20
    each = height / steps
    bar = [f'<rect x="{x:.1f}" y="{top + (steps - 1 - i) * each:.2f}" width="12" height="{each + 0.5:.2f}" '
           f'fill="{hex_color(i / (steps - 1))}"/>' for i in range(steps)]
    labels = (f'<text x="{x + 16:.1f}" y="{top + 10:.1f}" class="s">{peak:.3g}</text>'
              f'<text x="{x + 16:.1f}" y="{top + height:.1f}" class="s">0</text>')
    return "".join(bar) + labels


def _short(title: str, limit: int = 70) -> str:
    return title if len(title) <= limit else title[: limit - 1] + "…"


def image_json(result: HeadResult) -> dict[str, object] | None:
    """--json's `image`: the image as the model read it and its patch grid, and each overlay's cells."""
    picture = result.picture
    if picture is None:
        return None
    grid = picture.grid
    return {"path": picture.path, "processor": picture.processor, "height": grid.height, "width": grid.width,
            "patch": grid.patch, "rows": grid.rows, "cols": grid.cols, "n_patches": grid.n_patches,
            "first_patch": picture.first, "prefix": list(grid.prefix) if picture.start is None else [],
            "overlays": [{"title": o.title, "patches": o.cells, "prefix": dict(o.prefix)}
                         for o in head_overlays(result)]}
