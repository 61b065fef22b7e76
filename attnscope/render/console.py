"""The console, one-line errors and JSON output: what every other render module builds on."""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import uuid
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

from rich.console import Console

if TYPE_CHECKING:
    from torch import Tensor

PIPED_WIDTH = 80  # no terminal and no COLUMNS (`| cat`, `| less`): what an 80-column terminal shows unwrapped
COLUMNS_RANGE = (20, 1000)  # COLUMNS outside it (0, -1, "abc", 10**11) is nonsense, read as unset


def columns() -> int | None:
    """COLUMNS when it is a width a terminal can have, else None (read as unset: COLUMNS=0 would print nothing,
    COLUMNS=100000 would pad every line of --help to 100,000 spaces)."""
    text = os.environ.get("COLUMNS", "").strip()
    if not text.isdigit() or not COLUMNS_RANGE[0] <= int(text) <= COLUMNS_RANGE[1]:
        return None
    return int(text)


def ignore_bad_columns() -> None:
    """Unset a nonsense COLUMNS for this process, so that what reads it directly (Typer's --help, Rich) reads it as
    unset too. Called once by the command line's entry point."""
    width = columns()
    if width is not None:
        os.environ["COLUMNS"] = str(width)  # " 90" as 90 for Rich too, which reads digits only
    elif "COLUMNS" in os.environ:
        del os.environ["COLUMNS"]


def _terminal_width(stream: IO[str]) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns or PIPED_WIDTH
    except (OSError, ValueError):
        return PIPED_WIDTH


def stream_width(stream: IO[str]) -> int:
    """The width to print `stream` at: COLUMNS, else its terminal's, else (piped) 80."""
    width = columns()
    if width is None:
        width = _terminal_width(stream) if stream.isatty() else PIPED_WIDTH
    return width


def console(stderr: bool = False, record: bool = False, no_color: bool | None = None) -> Console:
    """stdout's console (stderr's with `stderr`); `record` keeps what is printed, for --svg/--html. The width is
    `stream_width`'s."""
    stream: IO[str] = sys.stderr if stderr else sys.stdout
    out = _Console(file=stream, width=stream_width(stream), highlight=False, soft_wrap=False, record=record,
                   no_color=no_color)
    out.size = out.size  # the height Rich reads now, kept: it asks the terminal again at every print otherwise
    return out


class _Console(Console):
    """Rich's console, but a reader that leaves early (`attnscope ... | head`) ends the command as it does for
    --json: the BrokenPipeError goes up to the command's error reporting (quiet, exit 141, as for a tool that
    SIGPIPE stops). Rich's own `on_broken_pipe` exits 1, which reads as a failure."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError

    def _render_buffer(self, buffer: Any) -> str:
        """Rich's text, without the blanks it pads a line with (a table's last column, a wrapped sentence): piped
        into a file or `diff`, no line ends in spaces. Only unstyled blanks right before a newline go: a styled
        cell's background keeps its spaces, as its reset code follows them."""
        return _TRAILING.sub("", super()._render_buffer(buffer))


_TRAILING = re.compile(" +(?=\n)")


def emit_json(payload: dict[str, Any]) -> None:
    """One JSON object on stdout. The keys are a documented contract (docs/json.md): add, never rename.
    JSON has no NaN or Infinity: the whole payload is cleaned (they become null), whatever key holds them,
    and dumped with allow_nan=False, so none can ever slip through. A tensor's values (`numbers`) are written
    each on one line by json's C encoder: the indented pure-Python encoder, one number a line, took 9 s for
    the 2.7M weights of a 16-layer --all-layers run, and cleaning them value by value 7 s more."""
    arrays: list[Numbers] = []
    nonce = uuid.uuid4().hex

    def aside(value: Numbers) -> str:  # each Numbers held aside for the C encoder, a placeholder in its place
        arrays.append(value)
        return f"{nonce}:{len(arrays) - 1}"

    text = json.dumps(clean(payload, aside), indent=2, allow_nan=False)
    if arrays:
        text = re.sub(f'"{nonce}:([0-9]+)"', lambda m: _array_text(arrays[int(m.group(1))]), text)
    sys.stdout.write(text + "\n")


def _array_text(values: Numbers) -> str:
    """One tensor's values as JSON: a float32 (float16, bfloat16) tensor's by numpy at once (jsonfloats.py, a
    third of the time json's encoder takes: every digit that tells the value, not the float64 repr of it), any
    other's by json's C encoder."""
    if values.source is None:
        return json.dumps(values, allow_nan=False)
    from attnscope.render.jsonfloats import float_text

    return float_text(values.source.detach().cpu().double().numpy())


class Numbers(list):  # type: ignore[type-arg]
    """A tensor's values as nested lists, every one finite: `clean` passes it whole, emit_json writes it compactly.
    `source`: the float32, float16 or bfloat16 tensor they were read from, which emit_json formats at once."""

    source: Tensor | None = None


def numbers(tensor: Tensor) -> list[Any]:
    """`tensor.tolist()` for JSON: checked finite in one vectorized test (the rare tensor with NaN or Infinity is
    cleaned value by value, as `clean` does)."""
    import torch

    values = tensor.tolist()
    if not isinstance(values, list):
        return clean(values)
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        return clean(values)  # type: ignore[no-any-return]
    held = Numbers(values)
    if tensor.dtype in (torch.float32, torch.float16, torch.bfloat16) and tensor.numel():
        held.source = tensor
    return held


def error(message: str) -> None:
    """One message on stderr: what was wrong and how to fix it (wrapped to the terminal, see `message_lines`)."""
    sys.stderr.write(message_lines("attnscope: error: ", message))


def info(message: str) -> None:
    sys.stderr.write(message_lines("attnscope: ", message))


CONTINUATION = "  "  # how a wrapped message's later lines start: a line that does not is a new message


def message_lines(prefix: str, message: str) -> str:
    """`prefix` and `message` as one message for stderr, wrapped at word boundaries to COLUMNS, else stderr's
    terminal, else (piped) 80 columns; its later lines start with CONTINUATION, so the first line starts as it
    always did (what a script greps) and each line that does not start with a space starts a message. A word
    longer than the width (a path) is kept whole, and a flag is never broken at its hyphens."""
    try:
        width = stream_width(sys.stderr)
    except (AttributeError, ValueError):  # a stream with no terminal behind it, or closed
        width = PIPED_WIDTH
    from attnscope.errors import printable

    text = prefix + " ".join(printable(message).split())  # an escape sequence in a name is shown, never acted on
    lines = textwrap.wrap(text, width, subsequent_indent=CONTINUATION, break_long_words=False,
                          break_on_hyphens=False)
    return "\n".join(lines or [prefix.rstrip()]) + "\n"


def finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None


def clean(value: Any, aside: Callable[[Numbers], Any] | None = None) -> Any:
    """JSON has no NaN or Infinity: they become null, in lists, tuples and dicts at any depth (a `Numbers` is
    finite already: it is kept whole, or replaced by what `aside` gives for it)."""
    if isinstance(value, float):
        return finite(value)
    if isinstance(value, Numbers):
        return value if aside is None else aside(value)
    if isinstance(value, (list, tuple)):
        return [clean(v, aside) for v in value]
    if isinstance(value, dict):
        return {k: clean(v, aside) for k, v in value.items()}
    return value


def shown_token(text: str) -> str:
    """A token's text on one line: control characters escaped, spaces shown as `␣` (tokenizer.token_label, which
    every view's token labels go through)."""
    from attnscope.models.tokenizer import token_label

    return token_label(text, text)


def path_lines(path: str, width: int) -> list[str]:
    """A path in lines of at most `width`, broken only after a `/` (a name longer than a line is cut, as nothing
    else can show it): a terminal's own wrapping breaks it mid-name."""
    lines = [""]
    for part in re.findall(r"[^/]*/|[^/]+$", path):
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines.append("")
        lines[-1] += part
    return [piece[k:k + width] for piece in lines for k in range(0, max(len(piece), 1), width)]
