"""A combined mask as a grid of ■ (may attend) and · (masked), and the same mask in other libraries' words."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from attnscope.render.fit import FittedText
from attnscope.words import counted

if TYPE_CHECKING:
    from attnscope.readings.maskview import MaskView

SEEN, HIDDEN = "■", "·"


def grid_lines(view: MaskView, width: int) -> list[Text]:
    """Rows = queries, columns = keys; as many keys as fit the width, the rest said in a line."""
    label = len(f"q{view.n_Q - 1}")
    fit = max(1, (width - label - 2) // 2)
    shown = min(view.n_K, fit)
    rows_shown = min(view.n_Q, 64)
    lines = [Text(" " * (label + 1) + " ".join(str(j % 10) for j in range(shown)) + "   (key j mod 10)")]
    for i in range(rows_shown):
        row = Text(f"q{i}".rjust(label) + " ")
        row.append(" ".join(SEEN if seen else HIDDEN for seen in view.grid[i][:shown]),
                   style="green")
        lines.append(row)
    if shown < view.n_K or rows_shown < view.n_Q:
        lines.append(Text(f"(showing {rows_shown} of {view.n_Q} queries and {shown} of {view.n_K} keys; "
                          "--json holds the whole mask)"))
    return lines


def show_grid(out: Console, view: MaskView) -> None:
    sizes = f"{counted(view.n_Q, 'query')} x {counted(view.n_K, 'key')}"
    out.print(Text(f"mask [{sizes}]: {SEEN} may attend, {HIDDEN} masked", style="bold"))
    out.print(FittedText(f"alignment: {view.describe()}"))  # wrapped at words, within the width
    out.print(FittedText("made of: " + "; ".join(view.parts)))
    for line in grid_lines(view, out.width):
        out.print(line)


def show_mask(out: Console, view: MaskView) -> None:
    """The `mask` command: the grid, then the same mask in each library's words."""
    show_grid(out, view)
    for library, code in view.translations.items():
        out.print()
        out.print(Text(library, style="bold cyan"))
        for line in code.splitlines():
            out.print(Text("  " + line), soft_wrap=True)


def mask_json(view: MaskView) -> dict[str, Any]:
    return {"shape": [view.n_Q, view.n_K], "grid": view.grid, "alignment": view.alignment,
            "offset": view.offset, "parts": view.parts}


def mask_command_json(view: MaskView, params: dict[str, Any]) -> dict[str, Any]:
    return {"command": "mask", "params": params, "mask": view.grid, "alignment": view.alignment,
            "offset": view.offset, "parts": view.parts, "translations": view.translations}
