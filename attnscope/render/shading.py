"""One weight, one cell, drawn for the console it is printed on: painted on the viridis scale where that
console shows colour, a shade character where it does not.

- On a terminal with 256 colours or truecolour (as Rich detects it, `Console.color_system`), a cell is a block
  of its weight's viridis colour (dark blue, low, to yellow, high). The block carries its own background, so
  the picture reads the same on dark and light terminals, and viridis is perceptually even and readable with
  the common colour-vision deficiencies.
- With no colour (a pipe, a dumb terminal), only 16 colours (too few for a perceptual scale), or NO_COLOR set,
  a cell is one of the shades ` ░▒▓█`, five levels from no weight to the most shown: more ink is more weight.
  Colour is never the only carrier: every picture has this form.
- The --svg/--html recording (render/export.py) is a truecolour console: the file gets the painted cells.

A line holding cells is a `CellLine`, which decides when it is rendered, so one printed line is right on the
terminal and in the recording alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

from rich.color import Color
from rich.console import Console, ConsoleOptions
from rich.style import Style
from rich.text import Text

from attnscope.colors import viridis

SHADES = " ░▒▓█"  # from no weight to the most shown
NOT_FINITE = "?"  # a NaN (or infinite) weight: not a shade, and left out of the scale
STEPS = 100  # colours are taken at this many steps of the scale (fewer styles, smaller exports)


def paints(out: Console) -> bool:
    """Whether this console shows the cells' colours: 256 colours or truecolour, and no NO_COLOR."""
    return not out.no_color and out.color_system in ("truecolor", "256")


@lru_cache(maxsize=STEPS + 1)
def _painted(step: int) -> Style:
    return Style(bgcolor=Color.from_rgb(*viridis(step / STEPS)))


def level(value: float, peak: float) -> int:
    """The shade of `value` on a scale from 0 to `peak`."""
    if not peak > 0:
        return 0
    return max(0, min(len(SHADES) - 1, int(round(value / peak * (len(SHADES) - 1)))))


def append_cell(text: Text, value: float, peak: float, width: int, colour: bool) -> None:
    """One cell, `width` characters wide: a block of its colour when `colour`, else its shade; `?` for NaN."""
    if not math.isfinite(value):
        text.append(NOT_FINITE * width)
    elif colour:
        fraction = min(1.0, max(0.0, value / peak)) if peak > 0 else 0.0
        text.append(" " * width, style=_painted(round(fraction * STEPS)))
    else:
        text.append(SHADES[level(value, peak)] * width)


@dataclass
class Cells:
    """Weights drawn as cells `width` characters wide, on a scale from 0 to `peak`."""

    values: list[float]
    peak: float
    width: int = 1


class CellLine:
    """One line of text and cells, drawn for the console that prints it (`paints`)."""

    def __init__(self, *pieces: str | Text | Cells) -> None:
        self.pieces = pieces

    def text(self, colour: bool) -> Text:
        line = Text()
        for piece in self.pieces:
            if isinstance(piece, Cells):
                for value in piece.values:
                    append_cell(line, value, piece.peak, piece.width, colour)
            else:
                line.append(piece)
        return line

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Text]:
        yield self.text(paints(console))


def ramp(low: str, high: str) -> CellLine:
    """The legend's scale, `low [  ░░▒▒▓▓██] high`: each step of the scale drawn as the cells are."""
    n = len(SHADES) - 1
    return CellLine(f"{low} [", Cells([i / n for i in range(n + 1)], 1.0, 2), f"] {high}")
