"""torch's compiler folder kept out of $TMPDIR.

Importing `torch._dynamo` makes `$TMPDIR/torchinductor_<user>` (torch._dynamo.package builds its disk cache at
import, through `torch._inductor.runtime.cache_dir_utils.cache_dir`), and attnscope never compiles anything. The
import cannot always be avoided: transformers' `activations` module, which every modeling file imports, imports
it through `torch.compiler.disable`, and torch's reference decompositions (an integer `//` on the meta device)
through `torch._disable_dynamo`. So a run that made the folder and left it empty removes it; one that found it
already there, or that finds anything in it, leaves it alone.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import tempfile
from collections.abc import Iterator

CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"  # set by cache_dir() to the folder it made


def default_folder() -> str:
    """The folder torch would make: `torch._inductor.runtime.cache_dir_utils.default_cache_dir`, matched."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.abspath(os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)))


@contextlib.contextmanager
def compiler_folder_kept_out() -> Iterator[None]:
    """Run the body; if it made torch's compiler folder (it was not there before, and the variable torch sets
    names it now) and the folder is still empty, remove it."""
    folder = None if CACHE_VARIABLE in os.environ else default_folder()
    existed = folder is None or os.path.lexists(folder)
    try:
        yield
    finally:
        if not existed and os.environ.get(CACHE_VARIABLE) == folder:
            with contextlib.suppress(OSError):  # not empty, or gone: not ours to touch
                os.rmdir(folder)  # type: ignore[arg-type]
