"""A forward parameter the code takes apart into two: RoPE's `(cos, sin)` handed in one argument under a name of the
model's own (nanochat's `forward(x, cos_sin, kv_cache)` with `cos, sin = cos_sin`; transformers' is named
`position_embeddings`, load.TABLE_NAMES). Read from the forward's own statements (with `ast`, never running
anything): the parameter unpacked into two names (`a, b = p`), or read at `p[0]` and `p[1]` alone. With --rope such a
parameter gets RoPE's tables, in the form the code then runs on (feeds.py, runs/trace.py); a pair of anything else
(`H, W = hw_shape`) is no input trace makes, as before.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any


def unpacked_in_two(fn: Any, names: list[str]) -> list[str]:
    """Those of `names` (the forward's parameters) that its body unpacks into exactly two, or indexes at 0 and 1
    alone; empty where the source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return []
    wanted = set(names)
    unpacked: set[str] = set()
    indexes: dict[str, set[object]] = {}
    plain: set[str] = set()  # used otherwise than at a constant index (handed on whole, sliced, ...)
    subscripted: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in wanted \
                and any(isinstance(t, (ast.Tuple, ast.List)) and len(t.elts) == 2
                        and not any(isinstance(e, ast.Starred) for e in t.elts) for t in node.targets):
            unpacked.add(node.value.id)
            subscripted.add(id(node.value))
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in wanted:
            subscripted.add(id(node.value))
            key = node.slice
            indexes.setdefault(node.value.id, set()).add(key.value if isinstance(key, ast.Constant) else None)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in wanted and isinstance(node.ctx, ast.Load) \
                and id(node) not in subscripted:
            plain.add(node.id)
    read_by_index = {n for n, keys in indexes.items() if keys == {0, 1}}
    return [n for n in names if n in unpacked or (n in read_by_index and n not in plain)]
