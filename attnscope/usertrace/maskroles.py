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
from typing import TYPE_CHECKING, Any

from attnscope.usertrace.astreads import PRODUCTS, called, climb, derived, is_layer, module_call, source_tree
from attnscope.usertrace.offscores import added_to, off_scores, returned_off

if TYPE_CHECKING:
    from attnscope.usertrace.load import Plan

COMBINED = (ast.Add, ast.Sub, ast.Mult)
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


def with_residuals(plan: Plan, fn: Any) -> Plan:
    """`plan` with each required tensor after the input that the code only adds to (or multiplies into) what it
    returns (a residual `shortcut + self.proj(out)`, never projected, never combined with the scores), or only adds
    to the input before projecting it (a position embedding under any name), handed a random tensor shaped as the
    input, as a position embedding is, no longer a second input (the memory of a cross-attention), with a note."""
    if not plan.tensors:
        return plan
    uses = {n: read(fn, n) for n in plan.tensors[1:]}
    returned = [n for n, found in uses.items() if found and found <= {"residual", "test"} and "residual" in found]
    # DETR's `q = self.q_proj(tgt + query_embed)` with `v = self.v_proj(tgt)`: added to the input before its
    # projections, never projected alone: the input's position embedding, whatever its name
    added = [n for n, found in uses.items() if found and found <= {"added", "residual", "test"} and "added" in found
             and added_to(fn, n, plan.tensors[0])]
    found = returned + added
    if not found:
        return plan
    said = {n: f"{n}: your code only combines it with what it returns (added or multiplied), never projects it and "
               "never combines it with its scores: read as a residual, given a random tensor shaped as the input, "
               "not a second input"
            for n in returned}
    said |= {n: f"{n}: your code adds it to {plan.tensors[0]} before projecting them, never projects it alone and "
                "never combines it with its scores: read as a position embedding, given a random tensor shaped as "
                "the input, not a second input" for n in added}
    return dataclasses.replace(plan, tensors=[n for n in plan.tensors if n not in found],
                               embeddings=[*plan.embeddings, *found],
                               embeddings_required=[*plan.embeddings_required, *found], said={**plan.said, **said})


def _home(fn: Any) -> str | None:
    try:
        path = inspect.getsourcefile(fn)
    except TypeError:
        return None
    return os.path.dirname(os.path.abspath(path)) if path else None


def _product(node: ast.AST) -> bool:
    """`q @ kᵀ`, `torch.matmul(q, k)`, `q.bmm(k)`, an einsum: the scores' product, as the expression is written."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return True
    return isinstance(node, ast.Call) and called(node) in PRODUCTS


def _read(fn: Any, name: str, depth: int, home: str | None) -> set[str]:
    tree = source_tree(fn)
    if tree is None:
        return set()
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    names = derived(tree, name)
    found: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names):
            continue
        kind = _use(node, parents, depth == DEPTH, getattr(fn, "__self__", None))
        if kind == "on":
            top, call = climb(node, parents)
            top, call = (call, parents.get(call)) if isinstance(call, ast.keyword) else (top, call)
            helper = _helper(fn, call, home) if depth > 0 and isinstance(call, ast.Call) else None
            param = _param(helper, call, top) if helper is not None and isinstance(call, ast.Call) else None
            if param is not None:
                inner = _read(helper, param, depth - 1, home)
                if "returned" in inner and call is not None:  # off the scores in the helper, then returned:
                    # where its caller takes it (BLOOM's dropout_add(out, residual, ...), then returned); handed in
                    # beside the scores' product (`_added(q @ kᵀ, bias)`), it is added to the scores: a mask's use
                    inner.discard("returned")
                    beside = [a for a in [*call.args, *(k.value for k in call.keywords)] if a is not top] \
                        if isinstance(call, ast.Call) else []
                    inner.add("mask" if any(_product(a) for a in beside) else
                              returned_off(call, parents, depth == DEPTH, getattr(fn, "__self__", None)) or "mask")
                found |= inner
            else:  # a layer of torch's (`self.k_proj(context)`) projects it; another's call may test it
                found.add("input" if isinstance(call, ast.Call) and is_layer(call.func) and helper is None else "on")
        elif kind == "kept":
            top, parent = climb(node, parents)
            if isinstance(parent, ast.Assign) and parent.value is top \
                    and any(isinstance(t, (ast.Tuple, ast.List)) for t in parent.targets):
                found.add("unpacked")  # `cos, sin = cos_sin`: several tensors, RoPE's tables, never one mask
        else:
            found.add(kind)
    return found


def _use(node: ast.AST, parents: dict[ast.AST, ast.AST], forward: bool = True, owner: Any = None) -> str:
    """How one read of the parameter (or a name made of it) reads it; `forward`: read in the forward itself, not in
    a helper it hands the parameter to (what a helper returns goes back to its caller); `owner`: the module whose
    layers it calls."""
    node, parent = climb(node, parents)
    if parent is None:
        return "value"
    if isinstance(parent, (ast.If, ast.IfExp, ast.While, ast.Assert)) and parent.test is node \
            or isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not) \
            or isinstance(parent, ast.Compare) or isinstance(parent, ast.BoolOp):
        return "test"
    if isinstance(parent, (ast.BinOp, ast.AugAssign)):
        op = parent.op
        off = off_scores(node, parent, parents, forward, owner) if isinstance(op, COMBINED) else None
        if off is not None:  # a position added to the input ("added"), a residual to the output: no mask
            return off
        return "input" if isinstance(op, ast.MatMult) else "mask" if isinstance(op, COMBINED) else "value"
    if isinstance(parent, ast.keyword):
        call = parents.get(parent)
        if isinstance(call, ast.Call):
            if parent.arg in ("mask", "condition") and called(call) in ("masked_fill", "masked_fill_", "where"):
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
    name = called(call)
    if is_layer(call.func) and name not in ("masked_fill", "where"):
        return "on" if keyword is not None or node in call.args else "value"
    if name in ("masked_fill", "masked_fill_"):
        method = isinstance(call.func, ast.Attribute) and not module_call(call.func)
        index = call.args.index(node) if node in call.args else -1
        return "mask" if (method and index == 0) or (not method and index == 1) else "value"
    if name == "where":
        return "mask" if call.args and call.args[0] is node else "value"
    if name in PRODUCTS or name in ("add", "mul", "sub"):
        return "input" if name in PRODUCTS else "mask"
    return "on"  # handed on: to a helper (followed where it is the user's) or to a library's call (that may test it)


def _helper(fn: Any, call: ast.Call, home: str | None) -> Any:
    """The user's own function or method `call` calls (defined in the forward's folder); None otherwise."""
    func, found = call.func, None
    if isinstance(func, ast.Name):
        found = getattr(getattr(fn, "__func__", fn), "__globals__", {}).get(func.id)
    elif is_layer(func) and hasattr(fn, "__self__"):
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
