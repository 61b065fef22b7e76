"""Reading how a forward's source uses one of its parameters, by its AST: the names the code makes of it alone, the
steps that keep it what it is (a cast, a reshape, a comparison, an operation with constants), the calls it meets
(a layer of the module's own, a library's function). maskroles.py and offscores.py read roles with these;
`source_tree` is the one parse of a forward's source that the readers share."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

PRODUCTS = ("matmul", "bmm", "einsum", "linear", "mm", "conv1d", "conv2d", "baddbmm")
SAME_MASK = ("bool", "float", "double", "half", "long", "int", "to", "type", "unsqueeze", "view", "reshape", "expand",
             "expand_as", "logical_not", "transpose", "permute", "squeeze", "contiguous", "flatten", "type_as")
MODULES = ("torch", "math", "np", "numpy", "float", "int", "F")


def source_tree(fn: Any) -> ast.Module | None:
    """The AST of `fn`'s source (a function, a bound method, a class), parsed once a run and shared by every reader
    (none reads it to change it); None where the source cannot be read or parsed."""
    fn = getattr(fn, "__func__", fn)  # a bound method's function: the cache never holds a module's weights
    try:
        return _parsed(fn)
    except TypeError:  # unhashable: parse it uncached
        return _parse(fn)


@functools.lru_cache(maxsize=256)
def _parsed(fn: Any) -> ast.Module | None:
    return _parse(fn)


def _parse(fn: Any) -> ast.Module | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (TypeError, ValueError, OSError, SyntaxError):
        return None


def derived(tree: ast.AST, name: str) -> set[str]:
    """`name` and the names the code makes of it alone, to a fixed point: an assignment whose value reaches it through
    steps that only reshape, cast, compare or scale it by constants (`neg = (1.0 - pad[:, None]) * -1e4`), never one
    that combines it with another tensor (the scores) or hands it to a call."""
    names = {name}
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    grown = True
    while grown:
        grown = False
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names):
                continue
            top, parent = climb(node, parents)
            if isinstance(parent, ast.Assign) and parent.value is top:
                for target in parent.targets:
                    for n in ast.walk(target):
                        if isinstance(n, ast.Name) and n.id not in names:
                            names.add(n.id)
                            grown = True
    return names


def climb(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> tuple[ast.AST, ast.AST | None]:
    """From a read of the mask up through the steps that keep it the mask alone (SAME_MASK's methods, an index, a
    comparison other than a test for None, `~`, `-`, a choice between two forms, an operation with constants): the
    outermost such expression and its parent."""
    parent = parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.UnaryOp) and not isinstance(parent.op, ast.Not) \
                or isinstance(parent, ast.Subscript) and parent.value is node \
                or isinstance(parent, ast.Compare) and not none_test(parent) \
                or isinstance(parent, ast.IfExp) and parent.test is not node \
                or isinstance(parent, ast.BinOp) and not isinstance(parent.op, ast.MatMult) \
                and constant(parent.right if parent.left is node else parent.left):
            node, parent = parent, parents.get(parent)
        elif isinstance(parent, ast.Attribute) and parent.attr in SAME_MASK:
            node, parent = parent, parents.get(parent)
            if isinstance(parent, ast.Call) and parent.func is node:
                node, parent = parent, parents.get(parent)
        else:
            break
    return node, parent


def constant(node: ast.AST) -> bool:
    """An expression of constants alone: numbers, `torch.finfo(x.dtype).min`, `float("-inf")`, `math.inf` (a tensor's
    name only under .dtype, .device or .shape)."""
    parents = {child: n for n in ast.walk(node) for child in ast.iter_child_nodes(n)}
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id not in MODULES:
            above = parents.get(n)
            if not (isinstance(above, ast.Attribute) and above.attr in ("dtype", "device", "shape")):
                return False
    return True


def is_layer(func: ast.AST) -> bool:
    """`self.k_proj(...)`, `self.qkv(...)`: a call of one of the module's own layers."""
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"


def called(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def module_call(func: ast.Attribute) -> bool:
    """`torch.masked_fill(...)`, `F.linear(...)`: a library's function, not a tensor's method."""
    return isinstance(func.value, ast.Name) and func.value.id in ("torch", "F", "nn", "functional")


def none_test(node: ast.Compare) -> bool:
    return all(isinstance(o, ast.Constant) and (o.value is None or isinstance(o.value, bool)) for o in node.comparators)
