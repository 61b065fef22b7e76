"""The name the user bound a result to: the target of the assignment statement that produced it.

The user's file is parsed once with ast; an op's line gives its statement, the statement's targets
(`scores = ...`, `Q, K, V = [...]`, `self.attn = ...`, `out["x"] = ...`) are read back from the frame's
locals right after the statement has run, and a target names the record whose result *is* that object.
Nothing of the user's is evaluated beyond plain attribute and constant-key lookups.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

COMPOUND = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.AsyncFor, ast.While,
            ast.With, ast.AsyncWith, ast.Try)
MAX_NAME = 28


class Statements:
    """Line -> the innermost simple statement of the user's file that spans it."""

    def __init__(self, path: Path) -> None:
        try:
            stat = path.stat()
            self._spans, self.lines = _parsed(str(path), stat.st_mtime_ns, stat.st_size)
        except OSError:  # gone since it was imported: no statements to name results by
            self._spans, self.lines = (), ()
        self._bound: dict[int, tuple[tuple[str, ...], int] | None] = {}

    def at(self, line: int) -> ast.stmt | None:
        for start, end, node in self._spans:  # narrowest first
            if start <= line <= end:
                return node
        return None

    def bound(self, line: int) -> tuple[tuple[str, ...], int] | None:
        """What the assignment at `line` binds, read from the source as written (never from the frame, whose names
        a later `k, v = v, k` may have swapped): its targets' names (`q, k, v = ...`: q, k, v; `self.k = ...`: k)
        and how many elements its value lists (`q, k, v = a, b, c`: 3; one expression unpacked: 0). None for any
        other statement, several targets or a starred or subscripted one."""
        if line not in self._bound:
            self._bound[line] = _bound(self.at(line))
        return self._bound[line]

    def source(self, line: int) -> str:
        return self.lines[line - 1].strip() if 0 < line <= len(self.lines) else ""


@functools.lru_cache(maxsize=8)
def _parsed(path: str, mtime_ns: int, size: int) -> tuple[tuple[tuple[int, int, ast.stmt], ...], tuple[str, ...]]:
    """The file's simple statements, narrowest first, and its lines: parsed once for each version of the file, where
    trace's plans and experiments record the same code tens of times a run. The trees are only read."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(text)
    except SyntaxError:  # already imported, so this cannot happen unless the file changed meanwhile
        tree = ast.Module(body=[], type_ignores=[])
    spans = sorted(((node.lineno, node.end_lineno or node.lineno, node) for node in ast.walk(tree)
                    if isinstance(node, ast.stmt) and not isinstance(node, COMPOUND)), key=lambda s: s[1] - s[0])
    return tuple(spans), tuple(text.splitlines())


def _bound(statement: ast.stmt | None) -> tuple[tuple[str, ...], int] | None:
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
        target, value = statement.targets[0], statement.value
    elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
        target, value = statement.target, statement.value
    else:
        return None
    leaves = list(target.elts) if isinstance(target, (ast.Tuple, ast.List)) else [target]
    names = tuple(n.id if isinstance(n, ast.Name) else n.attr for n in leaves
                  if isinstance(n, (ast.Name, ast.Attribute)))
    if len(names) != len(leaves):
        return None
    return names, len(value.elts) if isinstance(value, (ast.Tuple, ast.List)) and len(leaves) > 1 else 0


def targets(statement: ast.stmt | None) -> list[ast.expr]:
    """The leaf targets a statement binds: names, attributes and subscripts, tuples unpacked."""
    if isinstance(statement, ast.Assign):
        roots: list[ast.expr] = list(statement.targets)
    elif isinstance(statement, (ast.AnnAssign, ast.AugAssign)):
        roots = [statement.target]
    else:
        return []
    return list(_leaves(roots))


def _leaves(nodes: list[ast.expr]) -> Iterator[ast.expr]:
    for node in nodes:
        if isinstance(node, (ast.Tuple, ast.List)):
            yield from _leaves(list(node.elts))
        elif isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)):
            yield node


_MISSING = object()


def lookup(node: ast.expr, frame: FrameType) -> Any:
    """The current value of a target in a frame, for names, attributes and constant-key subscripts."""
    if isinstance(node, ast.Name):
        return frame.f_locals.get(node.id, frame.f_globals.get(node.id, _MISSING))
    if isinstance(node, ast.Attribute):
        base = lookup(node.value, frame)
        if base is _MISSING:
            return _MISSING
        try:
            return getattr(base, node.attr)
        except Exception:
            return _MISSING
    if isinstance(node, ast.Subscript):
        base = lookup(node.value, frame)
        if not isinstance(node.slice, ast.Constant):
            return base  # `scores[~mask] = -inf`: the tensor written into is the value bound
        key = node.slice.value
        try:
            if isinstance(base, dict):
                return base[key]
            if isinstance(base, (list, tuple)) and isinstance(key, int):
                return base[key]
            return _MISSING
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return _MISSING


def label(node: ast.expr) -> str:
    if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Constant):
        node = node.value
    text = ast.unparse(node)
    return text if len(text) <= MAX_NAME else text[: MAX_NAME - 1] + "…"


@dataclass
class Pending:
    """The records one execution of one statement produced, in one frame, waiting for it to finish."""

    frame: FrameType
    statement: ast.stmt
    lasti: int
    records: list[int] = field(default_factory=list)


class Binder:
    """Collects, per user frame, the records of the statement running there, and names them once the
    statement is over (a later op in that frame, or the end of the call)."""

    def __init__(self, statements: Statements, bind: Callable[[int, Any, str], bool]) -> None:
        self.statements = statements
        self._bind = bind  # (record index, the object the target holds, name) -> whether it is that record's
        self._pending: dict[int, Pending] = {}

    def add(self, frame: FrameType, line: int, index: int) -> None:
        statement = self.statements.at(line)
        key = id(frame)
        current = self._pending.get(key)
        # the same statement again with an earlier instruction: a loop came round, a new execution
        if current is not None and (current.statement is not statement or frame.f_lasti < current.lasti):
            self._resolve(current)
            current = None
        if statement is None:
            self._pending.pop(key, None)
            return
        if current is None:
            current = self._pending[key] = Pending(frame, statement, frame.f_lasti)
        current.lasti = frame.f_lasti
        current.records.append(index)

    def finish(self) -> None:
        for pending in list(self._pending.values()):
            self._resolve(pending)
        self._pending.clear()

    def _resolve(self, pending: Pending) -> None:
        for node in targets(pending.statement):
            value = lookup(node, pending.frame)
            if value is not _MISSING:
                for index in reversed(pending.records):  # the latest record holding it: the value bound
                    if self._bind(index, value, label(node)):
                        break
