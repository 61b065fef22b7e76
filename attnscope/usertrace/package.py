"""A traced file that lives in a package and imports from it relatively (`from .rotary import apply_rotary`,
transformers' own `from ...modeling_utils import PreTrainedModel`): the package it belongs to, so that its relative
imports resolve as Python resolves them when the package is imported (the file's `__package__`).

Read from the folders alone: the file's folder and each folder above it that holds an `__init__.py` make the
package (`src/mymodel/layers/attention.py` -> `mymodel.layers`, with `src` the folder put on sys.path). A file
with no relative import keeps being imported on its own, so nothing of a package's `__init__.py` runs for it.
"""

from __future__ import annotations

import ast
import keyword
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Package:
    name: str  # dotted: "mymodel.layers"
    root: Path  # the folder that holds its top package, put on sys.path while the file is imported

    @property
    def depth(self) -> int:
        """How many packages deep the file lies (1: in `mymodel`)."""
        return self.name.count(".") + 1


def relative_imports(source: str) -> int:
    """The most dots of the file's relative imports (`from ..utils import x`: 2); 0 where it has none or does not
    parse (the import then reports the syntax error)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return 0
    return max((node.level for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)), default=0)


def package_of(path: Path, source: str) -> Package | None:
    """The package `path` belongs to where it imports relatively and its folders make one; None otherwise (its
    relative imports then fail as under `python FILE.py`, in the user's own words)."""
    if relative_imports(source) == 0:
        return None
    parts: list[str] = []
    folder = path.resolve().parent
    while (folder / "__init__.py").is_file() and folder.name.isidentifier() and not keyword.iskeyword(folder.name):
        parts.insert(0, folder.name)
        if folder.parent == folder:
            break
        folder = folder.parent
    if not parts:
        return None
    return Package(".".join(parts), folder)
