"""Error reporting for every command: one line on stderr and an exit code, a traceback only with --debug.

Exit 2 for a bad option, argument, file or shape (`errors.UsageError`), exit 1 for a failure at run
time. The internal-error line ("... run again with --debug") is for real bugs only.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import typer

from attnscope.errors import AttnscopeError

# Typer re-exports BadParameter but not its bases; older Typer takes them from click, newer vendors its own
# copy. Found through the MRO, the same code works with both.
_CLICK_BASES = {cls.__name__: cls for cls in typer.BadParameter.__mro__}
ClickUsageError: type[Exception] = _CLICK_BASES["UsageError"]
ClickException: type[Exception] = _CLICK_BASES["ClickException"]


# The core names parameters as a Python caller writes them; a command line user reads the flag that sets each.
FLAGS = {"causal": "--causal", "window": "--window", "softcap": "--softcap", "scale": "--scale", "cache": "--cache",
         "pad": "--pad", "n_head": "--heads", "n_kv_head": "--kv-heads", "rope_base": "--rope-base", "meta": "--meta",
         "model": "--model", "text": "--text", "layer": "--layer", "head": "--head",
         "latent": "--kv-lora-rank", "kv_lora_rank": "--kv-lora-rank", "q_lora_rank": "--q-lora-rank",
         "qk_rope_head_dim": "--rope-head-dim", "qk_nope_head_dim": "--d-head", "v_head_dim": "--v-head-dim",
         "rope": "--rope", "chunk": "--chunk", "floor_scale": "--floor-scale", "attn_scale": "--attn-scale",
         "temperature": "--temperature-tuning", "alibi": "--alibi", "position_bias": "--position-bias",
         "target": "--target", "attention": "--attention", "audio": "--audio", "sinks": "--sinks",
         "window_side": "--window-side", "qk_norm": "--qk-norm", "generate": "--generate", "check": "--check",
         "image": "--image", "dense": "--dense", "query": "--query"}

OOM_ADVICE = "use --meta to see shapes and costs without allocating, or shrink the sizes"  # sdpa's and mha's
SHRINK_ADVICE = "shrink the inputs"  # a command without --meta

# What writing the output can fail with (stdout into a file on a full disk): errors of writes only, so an
# OSError with one of these and no file name is the output's. Every file attnscope writes goes through
# tensors/save.py, which names the file in its own line.
_WRITE_FAILURES = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}

_BOOLEAN_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0", "y", "n", "t", "f"}


def flag_value_hint(argv: list[str], flags: set[str], message: str) -> str:
    """The one line for `--check true`: Click says only "unexpected extra argument(s) (true)", which does not
    say that the option before it is a flag. `flags` are the command's flag options. Returns the better
    line, or "" where that is not the case."""
    if "unexpected extra argument" not in message:
        return ""
    for before, word in zip(argv, argv[1:], strict=False):
        if before in flags and word.lower() in _BOOLEAN_WORDS:
            if word.lower() in ("false", "no", "off", "0", "n", "f"):
                return f"{before} is a flag and takes no value: leave it out instead of '{before} {word}'"
            return f"{before} is a flag and takes no value: write '{before}' alone, not '{before} {word}'"
    return ""


def output_failed(exc: BaseException, *, certain: bool = False) -> bool:
    """Where `exc` is the output failing to be written (`certain`: it came from flushing stdout), say so in one
    line and point stdout at /dev/null, so that the interpreter's last flush of what is left in its buffer
    cannot fail a second time (a traceback, "Exception ignored"). False, and nothing done, otherwise."""
    if not isinstance(exc, OSError) or not (certain or (exc.filename is None and exc.errno in _WRITE_FAILURES)):
        return False
    from attnscope.render.console import error

    error(f"could not write the output ({exc.strerror or exc}); free space where it goes, or send it elsewhere")
    stdout_to_devnull()
    return True


def stdout_to_devnull() -> None:
    """Point stdout's file descriptor at /dev/null (the reader left, or the disk is full): what is still
    buffered then goes nowhere, quietly."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (a test's captured stdout)
        pass


@contextmanager
def reported(debug: bool, oom_advice: str = SHRINK_ADVICE, names: Mapping[str, str] | None = None) -> Iterator[None]:
    """Turn every failure into one line on stderr and an exit code; --debug shows the traceback instead.
    `oom_advice` names what the command offers when memory runs out: OOM_ADVICE's --meta only where the command
    has it (sdpa, mha). `names`: parameters this command sets otherwise than FLAGS says (anatomy's model is its
    MODEL argument, not --model)."""
    import warnings

    from attnscope import render

    if not debug:  # library warnings would add lines to a one-line error; --debug shows everything
        warnings.simplefilter("ignore")
    try:
        yield
    except (typer.Exit, typer.Abort, ClickException):
        raise
    except BrokenPipeError:  # `attnscope ... | head`: the reader left early, nothing to report
        stdout_to_devnull()  # what is still buffered goes nowhere, so no later flush fails again
        raise typer.Exit(141) from None  # 128 + SIGPIPE (Click's own handler would say 1, a failure)
    except AttnscopeError as exc:
        if debug and exc.exit_code != 2:  # a failure at run time: --debug shows where; a usage error is no bug
            import traceback

            traceback.print_exc()
        render.error(exc.worded({**FLAGS, **(names or {})}))
        raise typer.Exit(exc.exit_code) from None  # under --debug too: a usage error stays exit 2
    except KeyboardInterrupt:
        render.error("interrupted")
        raise typer.Exit(130) from None
    except MemoryError:
        if debug:
            raise
        render.error(f"out of memory; {oom_advice}")
        raise typer.Exit(1) from None
    except Exception as exc:  # a bug or a library failure: still one line, with the way to see more
        if debug:
            raise
        if output_failed(exc):
            raise typer.Exit(1) from None
        render.error(f"{type(exc).__name__}: {exc} (run again with --debug for the traceback)")
        raise typer.Exit(1) from None
