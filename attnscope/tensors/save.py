"""Saving tensors by name to .safetensors, .npz or .pt, keeping three promises:

- never a half-written file: the data goes to a temporary `.NAME.XXXX.part` beside the target, removed on any
  failure, on Ctrl-C, and on SIGTERM or SIGHUP;
- never a replaced file without `force`, checked at the moment the file appears: the finished file is
  published with `os.link`, which fails when the name exists (with `force`, `os.replace`: atomic);
- a symbolic link as the target is written through, as `open()` (and numpy, torch, safetensors, a shell's
  `>`) would: the file it points to is the one checked and replaced, and the link stays a link; but only to a
  regular file (or to nothing yet): a target that is a device, a pipe, a socket or a folder, named or reached
  through a link, is refused before anything is written, and no temporary file is made beside it (replacing
  /dev/full's node through a link with --force would have destroyed it). `os.replace` would replace whatever
  the name holds, so the check is made again just before the finished file takes the name.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnscope.errors import ResourceError, UsageError

if TYPE_CHECKING:
    import torch

SAVE_FORMATS = (".safetensors", ".npz", ".pt", ".pth")


class _Words:
    """How messages name the target and the way to allow replacing it: `--save X` and `--force` on the command
    line, the path and `force=True` for a Python caller."""

    def __init__(self, target: Path, option: str | None) -> None:
        self.target = f"{option} {target}" if option else str(target)
        self.force = "--force" if option else "force=True"


def check_writable(path: str | os.PathLike[str], force: bool = False, *, option: str | None = "--save",
                   formats: tuple[str, ...] = SAVE_FORMATS) -> Path:
    """Refuse, before any work, a target that is of an unknown type (not one of `formats`), exists (without
    force), or lies in a folder that is missing or cannot be written (tried for real: a temporary file is made
    and removed, since `os.access` says yes to root everywhere, /proc included). Messages name `option`
    (None: a Python caller)."""
    ending = " or ".join(formats) if len(formats) < 3 else f"one of {', '.join(formats)}"
    if not str(path):
        raise UsageError(f"{option or 'save_tensors'}: empty file name; give a file name ending in {ending}")
    target = Path(path)
    words = _Words(target, option)
    if target.suffix.lower() not in formats:
        raise UsageError(f"{words.target}: unknown file type; end the name with {ending}")
    real = _through_link(target)
    if real.is_dir():
        raise UsageError(f"{words.target}: is a folder; give a file name")
    _refuse_special(target, real, words)
    if real.exists() and not force:
        raise UsageError(f"{words.target}: the file exists; pass {words.force} to replace it")
    parent = real.parent
    if not parent.is_dir():
        raise UsageError(f"{words.target}: the folder {parent} does not exist")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{real.name}.", suffix=".part")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = "permission denied" if exc.errno in (errno.EACCES, errno.EPERM) else exc.strerror or str(exc)
        raise UsageError(f"{words.target}: cannot create a file in {parent} ({reason}); choose another folder") \
            from None
    return target


def _through_link(target: Path) -> Path:
    return Path(os.path.realpath(target)) if target.is_symlink() else target


def _refuse_special(target: Path, real: Path, words: _Words) -> None:
    """Refuse a target that is there and is not a regular file (a device, a pipe, a socket, a folder), itself
    or at the end of its link: only a regular file is ever replaced."""
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UsageError(f"{words.target}: cannot be checked ({exc.strerror or exc}); choose another name") from None
    if stat.S_ISREG(mode):
        return
    kind = ("a folder" if stat.S_ISDIR(mode) else "a character device" if stat.S_ISCHR(mode) else
            "a block device" if stat.S_ISBLK(mode) else "a pipe" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    through = f"a link to {real}, which is {kind}" if real != target else kind
    raise UsageError(f"{words.target}: is {through}, not a regular file; attnscope writes only to a regular file "
                     "(through a link too) and never replaces anything else: give another file name")


def save_tensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str], *, force: bool = False,
                 metadata: Mapping[str, Any] | None = None, option: str | None = None) -> Path:
    """Write tensors by name to .safetensors, .npz or .pt (by the extension), atomically.

    `metadata` (e.g. each step's dims and op) goes into the safetensors header and into .pt files; .npz has
    no place for it. An existing file is replaced only with `force`, and a file that appears while this
    runs is never replaced without it. `option` names the command-line option for messages (`"--save"`).
    """
    import torch

    target = check_writable(path, force, option=option)
    words = _Words(target, option)
    real = _through_link(target)
    if any(t.device.type == "meta" for t in tensors.values()):
        raise UsageError("--save needs real numbers, and --meta computes none; drop one of the two" if option
                         else f"{target}: meta tensors have no values to save")
    if real.suffix.lower() == ".npz" and any(t.dtype == torch.bfloat16 for t in tensors.values()):
        raise UsageError(f"{words.target}: .npz cannot hold bfloat16; save to .safetensors or .pt instead")
    # Contiguous private copies: safetensors refuses views that share memory (Q_split is a view of Q_feat).
    plain = {name: t.detach().cpu().contiguous().clone() for name, t in tensors.items()}
    _write_atomically(real, force, words, lambda tmp: _write(tmp, real.suffix.lower(), plain, metadata or {}))
    return target


def write_text(text: str, path: str | os.PathLike[str], *, force: bool = False, option: str | None = None,
               formats: tuple[str, ...]) -> Path:
    """Write `text` (UTF-8) to `path` with the same promises as `save_tensors`: `formats` are the endings
    allowed, nothing half-written, nothing replaced without `force`, a symlink written through."""
    target = check_writable(path, force, option=option, formats=formats)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)

    _write_atomically(_through_link(target), force, _Words(target, option), write)
    return target


def _write_atomically(real: Path, force: bool, words: _Words, write: Callable[[str], None]) -> None:
    """`write(tmp)` fills a temporary file beside `real`, which is then published under its name (`_publish`);
    on any failure, Ctrl-C, SIGTERM or SIGHUP the temporary file is removed and nothing is left."""
    tmp: str | None = None
    _refuse_special(real, real, words)  # again: the name may have changed since check_writable
    with _signals_clean_up():
        try:
            fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".part")
            os.close(fd)  # each format's writer opens the path itself
            write(tmp)
            os.chmod(tmp, _file_mode(real))
            _publish(tmp, real, force, words)
        except OSError as exc:
            raise ResourceError(f"{words.target}: could not write it ({exc.strerror or exc}); nothing was saved") \
                from None
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)


def _publish(tmp: str, real: Path, force: bool, words: _Words) -> None:
    """Give the finished file its name. With force, `os.replace` (atomic); else `os.link`, which refuses a name
    that exists, so a file that appeared while the run was computing is never replaced. Where a filesystem has
    no hard links, an `O_EXCL` placeholder claims the name first."""
    if force:
        _refuse_special(real, real, words)  # the last moment before os.replace, which replaces a device node too
        os.replace(tmp, real)
        return
    appeared = UsageError(f"{words.target}: a file appeared there while the run was computing; it was kept, and "
                          f"nothing was saved (pass {words.force} to replace it)")
    try:
        os.link(tmp, real)
    except FileExistsError:
        raise appeared from None
    except OSError:  # no hard links here (some network and FAT filesystems)
        try:
            os.close(os.open(real, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            raise appeared from None
        os.replace(tmp, real)


@contextmanager
def _signals_clean_up() -> Iterator[None]:
    """While a save runs, SIGTERM and SIGHUP exit as Ctrl-C does, through the `finally` that removes the
    temporary file, with the status the signal would have given (128 + its number). Only handlers left at
    their default are replaced, and only in the main thread (the only one that may set them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    replaced = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None and signal.getsignal(sig) is signal.SIG_DFL:
            replaced[sig] = signal.signal(sig, _exit_on_signal)
    try:
        yield
    finally:
        for sig, handler in replaced.items():
            signal.signal(sig, handler)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _file_mode(target: Path) -> int:
    """mkstemp makes its file private (0600); the saved file gets what a plain open() would give it, or
    keeps the mode of the file it replaces."""
    if target.exists():
        return target.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _write(path: str, suffix: str, tensors: dict[str, torch.Tensor], metadata: Mapping[str, Any]) -> None:
    """Every writer streams the tensors' own memory to the file: no second copy of the run in memory
    (safetensors' `save` would build the whole file as bytes, twice over, before writing it)."""
    import torch

    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(tensors, path, metadata={"attnscope": json.dumps(metadata)})
    elif suffix == ".npz":
        import numpy as np

        with open(path, "wb") as handle:  # a path would get ".npz" appended to the temporary name
            np.savez(handle, **{name: t.numpy() for name, t in tensors.items()})  # type: ignore[arg-type]
    else:
        torch.save({**tensors, "__attnscope__": dict(metadata)} if metadata else tensors, path)
