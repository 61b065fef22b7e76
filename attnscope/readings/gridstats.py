"""What a head does over an image's patch grid: the figures that replace the 1-D ones (previous token, distance in
positions) where the tokens are patches, and a vision-language model's text's share on its image.

The grid is read from the tokens' labels, which models/vision/patches.py writes from the model's own patch
layout (a Conv2d of kernel = stride = patch, flattened row-major: token `n_prefix + r * n_cols + c` is the patch
at row r, column c): a vision tower's `[CLS]`, DeiT's `[DIST]`, registers `reg0, reg1, ...`, then `p(r,c)`;
a VLM's prompt with its image's tokens `img(r,c)` (a second image's `img2(r,c)`) among the text's. Labels that
do not form a whole grid row by row are no grid (`layout` gives None), so a text never reads as one.

For a pattern A `[n_Q, n_K]` (query rows sum to 1), the figures average over the patch queries i (rows that may
see some key), each patch key j of the same image at (r_j, c_j):

- distance: `Σ_ij A[i, j] d(i, j) / Σ_ij A[i, j]` over patch queries and patch keys, d the Euclidean distance
  `√((r_i − r_j)² + (c_i − c_j)²)` in patches: the mean distance of the weight that lands on a patch (None where
  no weight does);
- self, row, column, neighbours: the mean of the row's weight on its own patch; on the other patches of its
  row; of its column; on its 8 neighbours (`max(|Δr|, |Δc|) = 1`);
- patches: on the patches (of its own image); cls, distillation, registers: on `[CLS]`, DeiT's `[DIST]`, the
  registers (None where the model has no such token): the special tokens, kept apart from the grid;
- text_to_image (a VLM): the mean, over the text queries after the image's first token, of the weight on the
  image's tokens (None for a vision tower).

A figure no query can have is None (JSON null), never NaN.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

PATCH = re.compile(r"^(p|img\d*)\((\d+),(\d+)\)$")  # p(3,7), img(0,1), img2(4,4)
REGISTER = re.compile(r"^reg\d+$")
CLS, DIST = "[CLS]", "[DIST]"
FIGURES = ("distance", "self", "row", "column", "neighbours", "patches", "cls", "distillation", "registers",
           "text_to_image")


@dataclass(frozen=True)
class Layout:
    """Where each token sits: `image[t]` the image its patch belongs to (-1: no patch), `row[t]`, `col[t]`;
    each image's `grids` (n_rows, n_cols); the special tokens' indices; `tower`: the tokens are a vision tower's
    (specials, then patches, no text)."""

    image: tuple[int, ...]
    row: tuple[int, ...]
    col: tuple[int, ...]
    grids: tuple[tuple[int, int], ...]
    cls: tuple[int, ...] = ()
    distillation: tuple[int, ...] = ()
    registers: tuple[int, ...] = ()
    tower: bool = False


def layout(labels: list[str]) -> Layout | None:
    """The patch grid the labels describe, or None where they are not one: each image's patches must run
    contiguously, row by row from (0,0), filling its n_rows x n_cols rectangle; a tower's tokens before the
    patches must all be special ([CLS], [DIST], regN)."""
    n = len(labels)
    image, row, col = [-1] * n, [0] * n, [0] * n
    names: list[str] = []
    for t, label in enumerate(labels):
        found = PATCH.match(label)
        if found is None:
            continue
        name = found.group(1)
        if name not in names:
            names.append(name)
        image[t], row[t], col[t] = names.index(name), int(found.group(2)), int(found.group(3))
    if not names:
        return None
    grids = []
    for k in range(len(names)):
        tokens = [t for t in range(n) if image[t] == k]
        n_rows, n_cols = max(row[t] for t in tokens) + 1, max(col[t] for t in tokens) + 1
        expected = [(i // n_cols, i % n_cols) for i in range(n_rows * n_cols)]  # row-major: r = i // n_cols
        if tokens != list(range(tokens[0], tokens[0] + len(tokens))) or [(row[t], col[t]) for t in tokens] != expected:
            return None
        grids.append((n_rows, n_cols))
    others = [t for t in range(n) if image[t] < 0]
    tower = names == ["p"]
    if tower and any(t > image.index(0) or not _special(labels[t]) for t in others):
        return None  # `p(r,c)` among a text's tokens, or after the patches: not a tower's layout
    if not tower and "p" in names:
        return None

    def special(name: str) -> tuple[int, ...]:
        return tuple(t for t in others if labels[t] == name) if tower else ()

    registers = tuple(t for t in others if REGISTER.match(labels[t])) if tower else ()
    return Layout(tuple(image), tuple(row), tuple(col), tuple(grids), special(CLS), special(DIST), registers, tower)


def _special(label: str) -> bool:
    return label in (CLS, DIST) or REGISTER.match(label) is not None


def grid_figures(A: Tensor, grid: Layout) -> list[dict[str, float | None]]:
    """The figures (module docstring) of each of G patterns `[G, n_tokens, n_tokens]` float64 over `grid`'s
    tokens: a dict of FIGURES per pattern."""
    import torch

    G, n_Q, _ = A.shape
    seen = A.sum(dim=-1) > 0  # [G, n_Q]: queries that may see some key
    sums: dict[str, Tensor] = {}
    counted = torch.zeros(G, dtype=torch.long)  # patch queries that see some key
    for k, (R, C) in enumerate(grid.grids):
        start = grid.image.index(k)
        span = slice(start, start + R * C)  # the image's patches, row-major
        rows = seen[:, span]  # [G, R * C]
        block = torch.where(rows[..., None], A[:, span, span], 0.0)  # [G, R * C, R * C]: its queries x its keys
        for name, total in _image_sums(block, R, C).items():
            sums[name] = sums[name] + total if name in sums else total
        counted += rows.sum(dim=-1)
    figures: dict[str, list[float | None]] = {
        name: [float(sums[name][g] / counted[g]) if counted[g] else None for g in range(G)]
        for name in ("self", "row", "column", "neighbours", "patches")}
    landed, moved = sums["patches"], sums["moved"]
    figures["distance"] = [float(moved[g] / landed[g]) if counted[g] and landed[g] > 0 else None for g in range(G)]
    patch = torch.tensor(grid.image) >= 0  # [n_tokens]
    queries = seen & patch[None, :]  # [G, n_Q]

    def mean(weight: Tensor, rows: Tensor) -> list[float | None]:  # weight [G, n_Q]: its mean over `rows`
        total = torch.where(rows, weight, 0.0).sum(dim=-1)
        n = rows.sum(dim=-1)
        return [float(total[g] / n[g]) if n[g] else None for g in range(G)]

    for name, tokens in (("cls", grid.cls), ("distillation", grid.distillation), ("registers", grid.registers)):
        figures[name] = mean(A[..., list(tokens)].sum(dim=-1), queries) if tokens else [None] * G
    if grid.tower:
        figures["text_to_image"] = [None] * G
    else:  # the text after the image's first token: how much of its weight the image takes
        text = seen & ~patch[None, :] & (torch.arange(n_Q) > grid.image.index(0))[None, :]  # [G, n_Q]
        figures["text_to_image"] = mean(A[..., patch].sum(dim=-1), text)
    return [{name: figures[name][g] for name in FIGURES} for g in range(G)]


def _image_sums(block: Tensor, R: int, C: int) -> dict[str, Tensor]:
    """One image's sums over its patch queries, `[G]` each, from `block` `[G, R * C, R * C]` (its patch queries x
    its patch keys, row-major): the weight on the own patch, the rest of the row and of the column, the 8
    neighbours, every patch, and `moved`, Σ A[i, j] d(i, j). The block is read as `[G, R, C, R', C']`, so that a
    row, a column or a neighbour is an index, not a mask over every pair (a DINOv2 at 518 pixels has 1,374
    tokens: 1.9 million pairs a head)."""
    import torch

    G = block.shape[0]
    cells = block.view(G, R, C, R, C)  # [G, r, c, r', c']
    own = block.diagonal(dim1=1, dim2=2).sum(dim=-1)  # [G]
    on_rows = cells.sum(dim=-1)  # [G, R, C, R']: each query's weight on each row of patches
    # a query's own row, Σ_c' cells[g, r, c, r, c'], is the diagonal over r, r' (itself left out); its column alike
    row = on_rows.diagonal(dim1=1, dim2=3).sum(dim=(1, 2)) - own
    column = cells.sum(dim=-2).diagonal(dim1=2, dim2=3).sum(dim=(1, 2)) - own  # [G, R, C, C'] -> over c, c'
    r, c = torch.arange(R, dtype=torch.float64), torch.arange(C, dtype=torch.float64)
    dr, dc = r[:, None] - r[None, :], c[:, None] - c[None, :]  # [R, R'], [C, C']
    distance = torch.sqrt(dr[:, None, :, None] ** 2 + dc[None, :, None, :] ** 2)  # [R, C, R', C'], in patches
    moved = block.reshape(G, -1) @ distance.reshape(-1)  # [G, (R C)²] @ [(R C)²] -> [G]
    i = torch.arange(R * C)
    step_r = torch.tensor([-1, -1, -1, 0, 0, 1, 1, 1])  # the 8 neighbours' offsets
    step_c = torch.tensor([-1, 0, 1, -1, 1, -1, 0, 1])
    nr, nc = (i // C)[:, None] + step_r, (i % C)[:, None] + step_c  # [R * C, 8]
    inside = (nr >= 0) & (nr < R) & (nc >= 0) & (nc < C)  # the neighbours that are on the image
    near = block.gather(-1, (nr * C + nc).where(inside, 0).expand(G, R * C, 8))  # [G, R * C, 8]
    return {"self": own, "row": row, "column": column, "neighbours": torch.where(inside, near, 0.0).sum(dim=(1, 2)),
            "patches": on_rows.sum(dim=(1, 2, 3)), "moved": moved}
