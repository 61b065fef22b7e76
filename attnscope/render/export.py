"""`--svg FILE` and `--html FILE`: what a command showed, written to a file that stands alone. Every command
gets them the same way (cli/common.py's `exporting`): the names are checked before the run, the command
prints to a recording console, and once its output is complete the record is exported.

- **Exactly what was shown**: the output is rendered once, on a recording console (Rich's
  `Console(record=True)`), and its record exported with `export_svg` / `export_html`: the same lines at the
  same width (tables, heatmaps, footers, notes).
- **In colour**, whatever the terminal had: NO_COLOR and pipes govern the terminal, not the file. The record
  keeps every style, and on a recording console a heatmap's cells carry their viridis colour
  (render/shading.py); in the file a painted cell is a clean block, its shade glyph left out.
- **Standalone and offline**: Rich's SVG template loads the Fira Code web font from a CDN; that `@font-face` and
  the generator's comment are taken out, and the text uses a monospace font the viewer has (Fira Code where
  installed, else DejaVu Sans Mono, Menlo, Consolas). Rich places every run of text at its column itself, so
  the columns stay aligned whatever the font. The HTML page is one `<pre>` with its stylesheet inline: no
  script, no link, no URL. Both use the dark theme Rich gives its SVGs.
- **The promises of --save** (attnscope.tensors.write_text): a name of the right type (`.svg`; `.html` or
  `.htm`), an existing file replaced only with --force (also one that appears while the run computes), nothing
  half-written. A command that fails before its output is complete writes nothing.
- `--json` prints JSON instead of the output, so it is refused beside --svg/--html (exit 2).
"""

from __future__ import annotations

import html
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

from rich.console import CONSOLE_SVG_FORMAT, Console
from rich.terminal_theme import SVG_EXPORT_THEME

from attnscope.errors import UsageError
from attnscope.render.console import console
from attnscope.render.shading import PALETTE, SHADES

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


def write(out: Console, exports: Exports) -> list[Path]:
    """Export what `out` recorded to the files asked for; each is published whole, or not at all."""
    from attnscope.tensors import write_text

    assert out.record, "exporting needs the recording console output_console gave"
    written = []
    if exports.svg:
        written.append(write_text(svg_text(out, exports.title), exports.svg, force=exports.force, option="--svg",
                                  formats=SVG_FORMATS))
    if exports.html:
        written.append(write_text(html_text(out, exports.title), exports.html, force=exports.force,
                                  option="--html", formats=HTML_FORMATS))
    return written


def svg_text(out: Console, title: str) -> str:
    """The SVG of what `out` recorded, each painted cell a clean block (its shade glyph left out: drawn in its
    own background's colour it shows nothing, and a fallback font's wider glyph would smear into the next
    cell). Its CSS classes are named from a checksum of the text (Rich's own default hashes the repr of every
    segment, which takes longer than drawing them)."""
    unique_id = f"attnscope-{zlib.crc32(out.export_text(clear=False).encode()):08x}"
    svg = out.export_svg(title=title, theme=SVG_EXPORT_THEME, clear=False, code_format=SVG_TEMPLATE,
                         unique_id=unique_id)
    rules = re.findall(rf"\.{re.escape(unique_id)}-(r\d+) \{{ fill: (#[0-9a-f]{{6}}) \}}", svg)
    painted = "|".join(name for name, fill in rules if fill in PALETTE)
    if not painted:
        return svg
    return re.sub(rf'<text class="{re.escape(unique_id)}-(?:{painted})"[^>]*>[{SHADES}]*</text>', "", svg)


def html_text(out: Console, title: str) -> str:
    """The HTML page of what `out` recorded, each painted cell's shade glyph a space (a block of colour that
    a fallback font cannot widen)."""
    template = HTML_TEMPLATE.replace("@TITLE@", _braces(html.escape(title))).replace("@FONTS@", FONTS)
    page = out.export_html(theme=SVG_EXPORT_THEME, clear=False, code_format=template, inline_styles=False)
    rules = re.findall(r"\.(r\d+) \{color: (#[0-9a-f]{6}); text-decoration-color: \2; background-color: \2\}",
                       page)
    painted = "|".join(name for name, color in rules if color in PALETTE)
    if not painted:
        return page
    return re.sub(rf'(<span class="(?:{painted})">)([{SHADES}]*)(</span>)',
                  lambda m: m.group(1) + " " * len(m.group(2)) + m.group(3), page)


def _braces(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")
