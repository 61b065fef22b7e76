"""Where in the user's own code an op ran: the traced file records each op at the line of that file it ran from (a
helper of the file's, or one it imports, runs at the line that calls it); a helper in another file of the user's
folder (`from masks import extended_bias` beside the traced file) is placed too, at its own file and line, so that
two branches of such a helper (`if mask.dim() == 2: ... elif mask.dim() == 3: ...`) read apart
(maskranks.path). Code outside the user's folder (torch, transformers, an installed package, a virtual environment
kept in the folder, attnscope's own) is never followed.
"""

from __future__ import annotations

import os
from types import FrameType

_INSTALLED = ("site-packages", "dist-packages")
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # attnscope's own code, never the user's


class Folder:
    """The user's folder (the traced file's), and which files lie in it."""

    def __init__(self, traced: str) -> None:
        self.traced, self._whole = traced, os.path.abspath(traced)
        self.root = os.path.dirname(self._whole) + os.sep
        self._known: dict[str, bool] = {}

    def holds(self, filename: str) -> bool:
        """Whether `filename` is a source file of the user's folder (or a folder in it) other than the traced one."""
        found = self._known.get(filename)
        if found is None:
            full = os.path.abspath(filename)
            found = not filename.startswith("<") and full.startswith(self.root) and full != self._whole \
                and not full.startswith(_OURS) and not any(
                part in _INSTALLED or part.startswith(".") for part in full[len(self.root):].split(os.sep)[:-1])
            self._known[filename] = found
        return found

    def helper_at(self, frame: FrameType | None) -> tuple[str, int] | None:
        """(file name in the folder, line) of the innermost frame of a helper file of the user's folder that runs
        inside the traced file's code, from `frame` (the op's caller) out; None where the op ran in the traced file
        itself or in no helper of the folder."""
        while frame is not None:
            filename = frame.f_code.co_filename
            if filename == self.traced:
                return None
            if self.holds(filename):
                return os.path.relpath(filename, self.root), frame.f_lineno
            frame = frame.f_back
        return None
