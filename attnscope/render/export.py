"""`--svg FILE` and `--html FILE`: what a command showed, written to a file that stands alone. Every command
gets them the same way (cli/common.py's `exporting`): the names are checked before the run, the command
prints to a recording console, and once its output is complete the record is exported.

- **Exactly what was shown**: the output is rendered once, on a recording console (Rich's
  `Console(record=True)`), and its record exported with `export_svg` / `export_html`: the same lines at the
  same width (tables, heatmaps, footers, notes).
- **In colour**, whatever the terminal had: NO_COLOR and pipes govern the terminal, not the file. The record
  keeps every style, and on a recording console a heatmap's cells carry their viridis colour
  (render/shading.py); in the file a painted cell is a clean block of colour, and a line the terminal soft-wrapped is
  wrapped at the same width (`prepare`).
- **Standalone and offline**: Rich's SVG template loads the Fira Code web font from a CDN; that `@font-face` and
  the generator's comment are taken out, and the text uses a monospace font the viewer has (Fira Code where
  installed, else DejaVu Sans Mono, Menlo, Consolas). Rich places every run of text at its column itself, so
  the columns stay aligned whatever the font. The HTML page is one `<pre>` with its stylesheet inline: no
  script, no link, no URL. Both use the dark theme Rich gives its SVGs.
- **The promises of --save** (attnscope.tensors.write_text): a name of the right type (`.svg`; `.html` or
  `.htm`), an existing file replaced only with --force (also one that appears while the run computes), nothing
  half-written. A command that fails before its output is complete writes nothing.
- `--json` prints JSON instead of the output, so it is refused beside --svg/--html (exit 2).

The commands that show attention (sdpa, mha, head, bert, trace) write a different --html: the interactive
explorer page of their result (attnscope/views/explorer.py), under the same promises; `--svg`, and `--html` of
mask and bench, are the record described here.
"""

from __future__ import annotations

import html
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

from rich.cells import cell_len
from rich.console import CONSOLE_SVG_FORMAT, Console
from rich.segment import Segment
from rich.style import Style
from rich.terminal_theme import SVG_EXPORT_THEME

from attnscope.errors import UsageError
from attnscope.render.console import console

SVG_FORMATS = (".svg",)
HTML_FORMATS = (".html", ".htm")
FONTS = "'Fira Code', 'DejaVu Sans Mono', Menlo, Consolas, 'Liberation Mono', monospace"

# Rich's own SVG template, less what it fetches (the web font) and its comment (a URL).
SVG_TEMPLATE = re.sub(r"font-family: Fira Code, monospace;", f"font-family: {FONTS};",
                      re.sub(r"\s*@font-face \{\{.*?\}\}", "", re.sub(r"\s*<!--.*?-->", "", CONSOLE_SVG_FORMAT,
                                                                     flags=re.S), flags=re.S))

HTML_TEMPLATE = """\
<!DOCTYPE html>
<html>
<head>
<meta charset="UTF-8">
<title>@TITLE@</title>
<style>
{stylesheet}
body {{
    color: {foreground};
    background-color: {background};
}}
pre {{
    font-family: @FONTS@;
    line-height: 1.2;
}}
</style>
</head>
<body>
<pre><code style="font-family:inherit">{code}</code></pre>
</body>
</html>
"""


@dataclass(frozen=True)
class Exports:
    """The files asked for, and how to name the output in them."""

    svg: str | None = None
    html: str | None = None
    force: bool = False
    title: str = "attnscope"

    def __bool__(self) -> bool:
        return bool(self.svg or self.html)


def check(exports: Exports, json: bool) -> None:
    """Before the run: --json is not beside them, they are two files, each can be written (no overwrite
    without --force)."""
    from attnscope.tensors import check_writable

    asked = " and ".join(flag for flag, name in (("--svg", exports.svg), ("--html", exports.html)) if name)
    if not exports:
        return
    if json:
        raise UsageError(f"{asked} write{'s' if ' and ' not in asked else ''} the output as shown, and --json prints "
                         f"JSON instead of it; drop --json, or {asked}")
    if exports.svg and exports.html and Path(exports.svg).resolve() == Path(exports.html).resolve():
        raise UsageError(f"--svg and --html both name {exports.svg}; give each its own file")
    if exports.svg:
        check_writable(exports.svg, exports.force, option="--svg", formats=SVG_FORMATS)
    if exports.html:
        check_writable(exports.html, exports.force, option="--html", formats=HTML_FORMATS)


def output_console(exports: Exports) -> Console:
    """The console the command prints to: stdout's, recording what it prints when something is to be exported
    (the file is then exactly what was shown, rendered once). A recording console paints the heatmaps' cells
    for the file (render/shading.py); on a 16-colour terminal, too few colours for them, the terminal itself
    is then shown no colour (NO_COLOR's way: the recording keeps every style)."""
    if not exports:
        return console()
    out = console(record=True)
    return console(record=True, no_color=True) if out.color_system in ("standard", "windows") else out


def write(out: Console, exports: Exports, html: str | None = None, svg: str | None = None) -> list[Path]:
    """Export what `out` recorded to the files asked for; each is published whole, or not at all. `html`, when
    given, is the page --html writes instead of the record (the explorer page of sdpa, mha, head, bert, trace);
    `svg`, when given, the picture --svg writes instead (head --image: the image with the weights on top)."""
    from attnscope.tensors import write_text

    assert out.record, "exporting needs the recording console output_console gave"
    prepare(out)
    written = []
    if exports.svg:
        written.append(write_text(svg if svg is not None else svg_text(out, exports.title), exports.svg,
                                  force=exports.force, option="--svg",
                                  formats=SVG_FORMATS))
    if exports.html:
        written.append(write_text(html if html is not None else html_text(out, exports.title), exports.html,
                                  force=exports.force, option="--html", formats=HTML_FORMATS))
    return written


def prepare(out: Console) -> None:
    """Make the record look in the file as the output looked on the terminal:

    - a painted cell (a shade glyph drawn in its own background's colour: invisible on the terminal) becomes
      a block of colour, spaces on that background: in a file a fallback font's wider glyph could smear into
      the next cell, and a cell without text is drawn as one rectangle (Rich writes no text element for
      spaces), which also makes the SVG quicker to write;
    - a line printed wider than the console (code printed with soft_wrap, to be pasted whole: `mask`'s
      translations) is wrapped at the width, as the terminal wrapped it, where the SVG would cut it.

    Rich keeps the record in `Console._record_buffer` and offers no public way to edit it; without it the
    record is exported as it is (the glyphs invisible on their colour, long lines cut in the SVG)."""
    record = getattr(out, "_record_buffer", None)
    if not isinstance(record, list):
        return
    painted: dict[Style, bool] = {}  # a few dozen styles for thousands of cells
    lines: list[Segment] = []
    for line in Segment.split_lines(record):
        for i, (text, style, control) in enumerate(line):
            if style is None:
                continue
            if style not in painted:
                painted[style] = style.bgcolor is not None and style.color == style.bgcolor
            if painted[style]:
                line[i] = Segment(" " * cell_len(text), style, control)
        length = Segment.get_line_length(line)
        parts = Segment.divide(line, [*range(out.width, length, out.width), length]) if length > out.width else [line]
        for part in parts:
            lines += [*part, Segment.line()]
    record[:] = lines


def svg_text(out: Console, title: str) -> str:
    """The SVG of what `out` recorded. Its CSS classes are named from a checksum of the text (Rich's own
    default hashes the repr of every segment, which takes longer than drawing them)."""
    unique_id = f"attnscope-{zlib.crc32(out.export_text(clear=False).encode()):08x}"
    return out.export_svg(title=title, theme=SVG_EXPORT_THEME, clear=False, code_format=SVG_TEMPLATE,
                          unique_id=unique_id)


def html_text(out: Console, title: str) -> str:
    template = HTML_TEMPLATE.replace("@TITLE@", _braces(html.escape(title))).replace("@FONTS@", FONTS)
    return out.export_html(theme=SVG_EXPORT_THEME, clear=False, code_format=template, inline_styles=False)


def _braces(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")
