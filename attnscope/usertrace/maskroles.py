"""A required parameter's role read from how the code uses it, where its name does not say: a mask (`keep`, `pad`,
`valid`, `attn_bias`) or a second input (cross-attention's `context`).

Read from the AST of the forward and of the helpers it hands the parameter to, where they are the user's own (a
function or method defined in the forward's file or folder, never torch's or transformers'), following the names the
code makes of it (`neg = (1.0 - keep) * -1e4`). Combined with the scores (an operand of `+`, `-` or `*`, the mask of
`masked_fill`, the condition of `where`) it is a mask; projected (the argument of a layer `self.k(context)`, an
operand of `@`, `matmul`, `bmm`, `einsum`, `linear`) it is an input. Only a parameter the code combines and never
projects is read as a mask.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import textwrap
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnscope.usertrace.load import Plan

PRODUCTS = ("matmul", "bmm", "einsum", "linear", "mm", "conv1d", "conv2d", "baddbmm")
COMBINED = (ast.Add, ast.Sub, ast.Mult)
SAME_MASK = ("bool", "float", "double", "half", "long", "int", "to", "type", "unsqueeze", "view", "reshape", "expand",
             "expand_as", "logical_not", "transpose", "permute", "squeeze", "contiguous", "flatten", "type_as")
MODULES = ("torch", "math", "np", "numpy", "float", "int", "F")
DEPTH = 3  # helpers followed: the forward's, theirs, and theirs


def read(fn: Any, name: str) -> set[str]:
    """How `fn` and the user's helpers it hands `name` to read it: "mask" (combined with the scores), "input"
    (projected), "test" (tested for None or its truth), "value" (any other read, a tensor's); empty where the source
    cannot be read."""
    return _read(fn, name, DEPTH, _home(fn))


def role(fn: Any, name: str) -> str | None:
    """"mask" where the code combines `name` with its scores and never projects it, nor unpacks it into several
    tensors (nanochat's `cos, sin = cos_sin`, RoPE's tables multiplied into q and k); None otherwise."""
    found = read(fn, name)
    return "mask" if "mask" in found and not found & {"input", "unpacked"} else None


def needed(fn: Any, name: str) -> bool:
    """Whether the code reads `name` only as a tensor, in the forward or in the helpers it hands it to (no test for
    None or its truth anywhere): None is then a value it cannot run on."""
    found = read(fn, name)
    return bool(found) and "test" not in found and "on" not in found


def with_masks(plan: Plan, fn: Any) -> Plan:
    """`plan` with its mask parameter read from the code where no name says one: the first required parameter after
    the input that the code uses as a mask (`role`), no longer a second input, with a note."""
    if plan.mask is not None or len(plan.tensors) < 2:
        return plan
    found = next((n for n in plan.tensors[1:] if role(fn, n) == "mask"), None)
    if found is None:
        return plan
    said = (f"{found}: your code combines it with its scores (added, a masked_fill's mask, a where's condition or "
            "multiplied into the weights) and never projects it, so it was read as the mask, not a second input")
    return dataclasses.replace(plan, tensors=[n for n in plan.tensors if n != found], mask=found,
                               said={**plan.said, found: said})


def _home(fn: Any) -> str | None:
    try:
        path = inspect.getsourcefile(fn)
    except TypeError:
        return None
    return os.path.dirname(os.path.abspath(path)) if path else None


def _read(fn: Any, name: str, depth: int, home: str | None) -> set[str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (TypeError, ValueError, OSError, SyntaxError):
        return set()
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    names = _derived(tree, name)
    found: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names):
            continue
        kind = _use(node, parents)
        if kind == "on":
            top, call = _climb(node, parents)
            top, call = (call, parents.get(call)) if isinstance(call, ast.keyword) else (top, call)
            helper = _helper(fn, call, home) if depth > 0 and isinstance(call, ast.Call) else None
            param = _param(helper, call, top) if helper is not None and isinstance(call, ast.Call) else None
            if param is not None:
                found |= _read(helper, param, depth - 1, home)
            else:  # a layer of torch's (`self.k_proj(context)`) projects it; another's call may test it
                found.add("input" if isinstance(call, ast.Call) and _is_layer(call.func) and helper is None else "on")
        elif kind == "kept":
            top, parent = _climb(node, parents)
            if isinstance(parent, ast.Assign) and parent.value is top \
                    and any(isinstance(t, (ast.Tuple, ast.List)) for t in parent.targets):
                found.add("unpacked")  # `cos, sin = cos_sin`: several tensors, RoPE's tables, never one mask
        else:
            found.add(kind)
    return found


def _derived(tree: ast.AST, name: str) -> set[str]:
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
            top, parent = _climb(node, parents)
            if isinstance(parent, ast.Assign) and parent.value is top:
                for target in parent.targets:
                    for n in ast.walk(target):
                        if isinstance(n, ast.Name) and n.id not in names:
                            names.add(n.id)
                            grown = True
    return names


def _climb(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> tuple[ast.AST, ast.AST | None]:
    """From a read of the mask up through the steps that keep it the mask alone (SAME_MASK's methods, an index, a
    comparison other than a test for None, `~`, `-`, a choice between two forms, an operation with constants): the
    outermost such expression and its parent."""
    parent = parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.UnaryOp) and not isinstance(parent.op, ast.Not) \
                or isinstance(parent, ast.Subscript) and parent.value is node \
                or isinstance(parent, ast.Compare) and not _none_test(parent) \
                or isinstance(parent, ast.IfExp) and parent.test is not node \
                or isinstance(parent, ast.BinOp) and not isinstance(parent.op, ast.MatMult) \
                and _constant(parent.right if parent.left is node else parent.left):
            node, parent = parent, parents.get(parent)
        elif isinstance(parent, ast.Attribute) and parent.attr in SAME_MASK:
            node, parent = parent, parents.get(parent)
            if isinstance(parent, ast.Call) and parent.func is node:
                node, parent = parent, parents.get(parent)
        else:
            break
    return node, parent


def _constant(node: ast.AST) -> bool:
    """An expression of constants alone: numbers, `torch.finfo(x.dtype).min`, `float("-inf")`, `math.inf` (a tensor's
    name only under .dtype, .device or .shape)."""
    parents = {child: n for n in ast.walk(node) for child in ast.iter_child_nodes(n)}
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id not in MODULES:
            above = parents.get(n)
            if not (isinstance(above, ast.Attribute) and above.attr in ("dtype", "device", "shape")):
                return False
    return True


def _is_layer(func: ast.AST) -> bool:
    """`self.k_proj(...)`, `self.qkv(...)`: a call of one of the module's own layers."""
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"


def _use(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    """How one read of the parameter (or a name made of it) reads it."""
    node, parent = _climb(node, parents)
    if parent is None:
        return "value"
    if isinstance(parent, (ast.If, ast.IfExp, ast.While, ast.Assert)) and parent.test is node \
            or isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not) \
            or isinstance(parent, ast.Compare) or isinstance(parent, ast.BoolOp):
        return "test"
    if isinstance(parent, (ast.BinOp, ast.AugAssign)):
        op = parent.op
        return "input" if isinstance(op, ast.MatMult) else "mask" if isinstance(op, COMBINED) else "value"
    if isinstance(parent, ast.keyword):
        call = parents.get(parent)
        if isinstance(call, ast.Call):
            if parent.arg in ("mask", "condition") and _called(call) in ("masked_fill", "masked_fill_", "where"):
                return "mask"
            return _in_call(call, node, parent.arg)
    if isinstance(parent, ast.Call):
        if parent.func is node:
            return "value"
        return _in_call(parent, node, None)
    if isinstance(parent, (ast.Assign, ast.Return, ast.Tuple, ast.List)):
        return "kept"
    return "value"


def _in_call(call: ast.Call, node: ast.AST, keyword: str | None) -> str:
    name = _called(call)
    if _is_layer(call.func) and name not in ("masked_fill", "where"):
        return "on" if keyword is not None or node in call.args else "value"
    if name in ("masked_fill", "masked_fill_"):
        method = isinstance(call.func, ast.Attribute) and not _module_call(call.func)
        index = call.args.index(node) if node in call.args else -1
        return "mask" if (method and index == 0) or (not method and index == 1) else "value"
    if name == "where":
        return "mask" if call.args and call.args[0] is node else "value"
    if name in PRODUCTS or name in ("add", "mul", "sub"):
        return "input" if name in PRODUCTS else "mask"
    return "on"  # handed on: to a helper (followed where it is the user's) or to a library's call (that may test it)


def _called(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _module_call(func: ast.Attribute) -> bool:
    """`torch.masked_fill(...)`, `F.linear(...)`: a library's function, not a tensor's method."""
    return isinstance(func.value, ast.Name) and func.value.id in ("torch", "F", "nn", "functional")


def _none_test(node: ast.Compare) -> bool:
    return all(isinstance(o, ast.Constant) and (o.value is None or isinstance(o.value, bool)) for o in node.comparators)


def _helper(fn: Any, call: ast.Call, home: str | None) -> Any:
    """The user's own function or method `call` calls (defined in the forward's folder); None otherwise."""
    func, found = call.func, None
    if isinstance(func, ast.Name):
        found = getattr(getattr(fn, "__func__", fn), "__globals__", {}).get(func.id)
    elif _is_layer(func) and hasattr(fn, "__self__"):
        found = getattr(fn.__self__, func.attr, None)  # type: ignore[attr-defined]
        found = getattr(found, "forward", found) if not inspect.ismethod(found) else found
    if home is None or not (inspect.isfunction(found) or inspect.ismethod(found)):
        return None
    return found if _home(found) == home else None


def _param(helper: Any, call: ast.Call, node: ast.AST) -> str | None:
    """The helper's parameter that `node`, an argument of `call`, is bound to."""
    try:
        params = list(inspect.signature(helper).parameters)
    except (TypeError, ValueError):
        return None
    for i, arg in enumerate(call.args):
        if arg is node:
            return params[i] if i < len(params) else None
    return next((k.arg for k in call.keywords if (k is node or k.value is node) and k.arg in params), None)
