"""Tables that fit the terminal without breaking a token.

A cell's text is cut into atoms, the pieces a line may break between: at spaces outside brackets, and
before a chained call (`.view(...)` | `.permute(...)`); an operator stays with what follows it (`= [2, 4]`,
`/ sqrt(d_K)`), so `[n_batch, n_head, n_Q, d_head]` and `K.transpose(-2, -1)` never break. When the table
is too wide, columns give up width in their `shrink` order (wrapping their cells between atoms, down to
their longest atom), then whole columns are left out in their `drop` order and the table says so. Only a
single atom wider than the terminal is ever broken, after a comma first. Widths are display widths
(`rich.cells.cell_len`), so CJK text lines up.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from rich import box
from rich.cells import cell_len, chop_cells
from rich.console import Console, ConsoleOptions
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

OPERATORS = frozenset({"=", "@", "/", "*", "+", "-", "·", "->", "×"})
OPEN, CLOSE = "([{", ")]}"


def atoms(text: str) -> list[str]:
    """`Q @ K.transpose(-2, -1) / sqrt(d_K)` -> `Q`, ` @ K.transpose(-2, -1)`, ` / sqrt(d_K)`: each atom
    after the first starts with the space it follows (dropped where it starts a line)."""
    pieces: list[str] = []
    current, depth = "", 0
    for i, char in enumerate(text):
        at_top = depth == 0
        if at_top and char == " " and current.strip() and (i == 0 or text[i - 1] != " "):
            pieces.append(current)
            current = ""
        elif at_top and char == "." and current.endswith(tuple(CLOSE)):
            pieces.append(current)
            current = ""
        current += char
        depth = max(0, depth + (char in OPEN) - (char in CLOSE))
    pieces.append(current)
    merged: list[str] = []
    for piece in pieces:  # an operator goes to the start of the next line, not the end of this one
        if merged and merged[-1].strip() in OPERATORS:
            merged[-1] += piece
        else:
            merged.append(piece)
    return [p for p in merged if p]


def wrap(pieces: Sequence[str], width: int) -> list[str]:
    """Atoms filled greedily into lines of at most `width` cells; an atom wider than that is split after its
    commas, and only then chopped."""
    lines: list[str] = []
    line = ""
    for piece in _narrow(pieces, width):
        if line and cell_len(line + piece) > width:
            lines.append(line)
            line = piece.lstrip()
        else:
            line = line + piece if line else piece.lstrip()
    lines.append(line)
    return lines


def _narrow(pieces: Sequence[str], width: int) -> Iterator[str]:
    for piece in pieces:
        if cell_len(piece.lstrip()) <= width:
            yield piece
            continue
        for part in re.split(r"(?<=,)(?= )", piece):
            yield from (part,) if cell_len(part.lstrip()) <= width else chop_cells(part.lstrip(), width)


def wrap_line(line: str, width: int) -> list[str]:
    """A line of prose or a header: broken first where it has two or more spaces (between `n_Q=4  n_K=6`,
    or a title and its formula), then between atoms."""
    out: list[str] = []
    current = ""
    for segment in re.split(r"(?<=\S)(?=  +\S)", line):
        if current and cell_len(current + segment) <= width:
            current += segment
            continue
        if current:
            out.append(current)
        lines = wrap(atoms(segment.lstrip()), width)
        out.extend(lines[:-1])
        current = lines[-1]
    out.append(current)
    return out


class FittedText:
    """Lines of text (a header, a footer, a note) wrapped for the width they are printed at, never inside
    brackets."""

    def __init__(self, text: str, style: str | None = None) -> None:
        self.text, self.style = text, style

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Text]:
        lines = [part for line in self.text.split("\n") for part in wrap_line(line, options.max_width)]
        yield Text("\n".join(lines), style=self.style or "")


@dataclass
class Column:
    header: str
    justify: str = "left"
    style: str | None = None
    drop: int | None = None  # columns are left out in this order when nothing else fits; None: never


Paragraph = tuple[list[str], str | None]  # atoms and a style; each paragraph of a cell starts a new line


def cell(*paragraphs: Paragraph) -> list[Paragraph]:
    return list(paragraphs)


def whole(text: str, style: str | None = None) -> Paragraph:
    """A paragraph that is never broken (numbers, sizes, names)."""
    return [text], style


def broken(text: str, style: str | None = None) -> Paragraph:
    """A paragraph that may break between its atoms."""
    return atoms(text), style


class FittedTable:
    """A Rich renderable: the table laid out for the width it is printed at."""

    def __init__(self, columns: Sequence[Column], rows: Sequence[Sequence[list[Paragraph]]],
                 shrink: Sequence[int] = (), title: str | None = None) -> None:
        self.columns, self.rows, self.title = list(columns), [list(r) for r in rows], title
        # give up width in this order: the named columns first, then any other (whose headers may then fold)
        self.shrink = [*shrink, *(i for i in range(len(self.columns)) if i not in shrink)]

    def layout(self, console: Console, width: int) -> tuple[Table, list[str]]:
        keep = list(range(len(self.columns)))
        while True:
            widths = self._widths(keep, console, width)
            droppable = [i for i in keep if self.columns[i].drop is not None]
            if widths is not None or not droppable:
                break
            keep.remove(min(droppable, key=lambda i: self.columns[i].drop or 0))
        if widths is None:  # even the narrowest layout is too wide: the shrinkable columns take what is left
            widths = self._widths(keep, console, width, squeeze=True) or {}
        gone = sorted((i for i in range(len(self.columns)) if i not in keep), key=lambda i: self.columns[i].drop or 0)
        left_out = [self.columns[i].header for i in gone]
        return self._table(keep, widths), left_out

    def _widths(self, keep: list[int], console: Console, width: int, squeeze: bool = False) -> dict[int, int] | None:
        natural = {i: self._natural(i) for i in keep}
        smallest = {i: self._smallest(i) for i in keep}
        chrome = _chrome(console, len(keep))
        excess = chrome + sum(natural.values()) - width
        widths = dict(natural)
        for i in (i for i in self.shrink if i in keep):
            give = min(excess, widths[i] - smallest[i])
            if give > 0:
                widths[i] -= give
                excess -= give
        if excess <= 0:
            return widths
        if not squeeze:
            return None
        first = next(i for i in self.shrink if i in keep)
        widths[first] = max(1, widths[first] - excess)
        return widths

    def _natural(self, i: int) -> int:
        texts = [self.columns[i].header] + ["".join(p) for row in self.rows for p, _ in row[i]]
        return max(cell_len(t) for t in texts)

    def _smallest(self, i: int) -> int:
        pieces = atoms(self.columns[i].header) + [a for row in self.rows for p, _ in row[i] for a in p]
        return max(cell_len(a.lstrip()) for a in pieces)

    def _table(self, keep: list[int], widths: dict[int, int]) -> Table:
        table = _empty_table(self.title)
        for i in keep:
            column = self.columns[i]
            table.add_column("\n".join(wrap(atoms(column.header), widths[i])), justify=column.justify,  # type: ignore[arg-type]
                             style=column.style, no_wrap=True, width=widths[i])
        for row in self.rows:
            table.add_row(*(_text(row[i], widths[i]) for i in keep))
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Table | Text]:
        table, left_out = self.layout(console, options.max_width)
        yield table
        if left_out:
            yield from FittedText(f"left out to fit {options.max_width} columns: {', '.join(left_out)} "
                                  "(--json has them)").__rich_console__(console, options)


def _text(paragraphs: list[Paragraph], width: int) -> Text:
    text = Text()
    for n, (pieces, style) in enumerate(paragraphs):
        text.append(("\n" if n else "") + "\n".join(wrap(pieces, width)), style=style)
    return text


def _chrome(console: Console, n_columns: int) -> int:
    """What the table's edges, separators and padding take, beyond its columns' widths."""
    table = _empty_table()
    for _ in range(n_columns):
        table.add_column("x", width=1, no_wrap=True)
    return Measurement.get(console, console.options.update(width=10**4), table).maximum - n_columns


def _empty_table(title: str | None = None) -> Table:
    return Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False, collapse_padding=True)
