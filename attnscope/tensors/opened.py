"""A command's opened tensor files: within `one_read`, each file is opened once (a `.pt`'s pickle unpickled once,
another format's header parsed once and each of its tensors read once), however many flags name it and
whether the memory guard or the run asks first.

What is kept lives as long as the `one_read` block, a command's run (runs/sdpa.py, runs/mha.py, ...), never the
process: in a notebook the same path may be written again between two commands, and the next command reads it
afresh. Outside a block every read opens the file (`load_tensor` called from Python). Within one, a file is
known by its resolved path and what `os.stat` says of it (device, inode, size, modification and change times in
nanoseconds), so a file replaced or rewritten halfway through a command is opened again, not taken for the one
read before.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_HELD: ContextVar[dict[tuple[Any, ...], Any] | None] = ContextVar("attnscope_opened_files", default=None)


@contextmanager
def one_read() -> Iterator[None]:
    """Each tensor file opened once inside the block; a block inside another shares the outer one's files."""
    if _HELD.get() is not None:
        yield
        return
    token = _HELD.set({})
    try:
        yield
    finally:
        _HELD.reset(token)  # what was opened goes with the block (the tensors handed out keep their own data)


def identity(path: Path) -> tuple[Any, ...]:
    """The file as a command sees it: its resolved path and os.stat's device, inode, size, mtime and ctime (ns)."""
    found = os.stat(path)
    return (str(path.resolve()), found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns)


def opened(path: Path, kind: str, open_file: Callable[[], T]) -> T:
    """`open_file()`'s result for `path`, opened once per `one_read` block (`kind` tells apart what different
    callers keep of one file); outside a block, opened every time. A failure is not kept: it is raised again
    by the next caller's own opening."""
    held = _HELD.get()
    if held is None:
        return open_file()
    key = (kind, *identity(path))
    if key not in held:
        held[key] = open_file()
    return held[key]  # type: ignore[no-any-return]


def active() -> bool:
    """Whether a `one_read` block is open here."""
    return _HELD.get() is not None
