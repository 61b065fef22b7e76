"""`--svg FILE` and `--html FILE`: what a command showed, written to a file that stands alone. Every command
gets them the same way (cli/common.py's `exporting`): the names are checked before the run, the command
prints to a recording console, and once its output is complete the record is exported.

- **Exactly what was shown**: the same lines at the same width (tables, heatmaps, footers, notes), from Rich's
  `Console(record=True)` and its `export_svg` / `export_html`.
- **In colour**, whatever the terminal had: NO_COLOR and pipes govern the terminal, not the file. The recording
  keeps every style, and a heatmap's cells are painted on the viridis scale (render/shading.py).
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
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import CONSOLE_SVG_FORMAT, Console
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


class Recorded(Console):
    """stdout's console, whose every `print` also goes to `recording`: a truecolour console of the same width
    that keeps what it is given (`Console(record=True)`), so the file is in colour whatever the terminal
    shows. Each renderable is laid out for each console; at the same width they give the same lines, and a
    heatmap's cells come out as shades on a terminal without colour and painted in the recording."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.recording = Console(file=io.StringIO(), width=self.width, color_system="truecolor", no_color=False,
                                 force_terminal=True, force_jupyter=False, highlight=False, soft_wrap=False,
                                 record=True)

    def print(self, *objects: Any, **kwargs: Any) -> None:
        super().print(*objects, **kwargs)
        self.recording.print(*objects, **kwargs)


def output_console(exports: Exports) -> Console:
    """The console the command prints to: stdout's, recording too when something is to be exported."""
    return console(cls=Recorded) if exports else console()


def write(out: Console, exports: Exports) -> list[Path]:
    """Export what `out` recorded to the files asked for; each is published whole, or not at all."""
    from attnscope.tensors import write_text

    assert isinstance(out, Recorded), "exporting needs the console output_console gave"
    recording = out.recording
    written = []
    if exports.svg:
        written.append(write_text(svg_text(recording, exports.title), exports.svg, force=exports.force, option="--svg",
                                  formats=SVG_FORMATS))
    if exports.html:
        written.append(write_text(html_text(recording, exports.title), exports.html, force=exports.force,
                                  option="--html", formats=HTML_FORMATS))
    return written


def svg_text(out: Console, title: str) -> str:
    return out.export_svg(title=title, theme=SVG_EXPORT_THEME, clear=False, code_format=SVG_TEMPLATE)


def html_text(out: Console, title: str) -> str:
    template = HTML_TEMPLATE.replace("@TITLE@", _braces(html.escape(title))).replace("@FONTS@", FONTS)
    return out.export_html(theme=SVG_EXPORT_THEME, clear=False, code_format=template, inline_styles=False)


def _braces(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")
