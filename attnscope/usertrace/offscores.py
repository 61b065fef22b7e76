"""Whether a parameter the code adds to (or multiplies by) another tensor is off the scores: a residual added to
what the module returns (`shortcut + self.proj(out)`), a position embedding added to the input before its projections
(`self.q_proj(tgt + query_embed)`), rather than a mask combined with the scores. Read from the forward's AST: the
other operand is no attention weights (nothing a softmax made, elementwise) and the combination's value reaches no
softmax, every path from it ending in a projection or the return. Any other path (a helper's call, a library's
function that may take the scores) is left on the scores (maskroles.py reads a mask there)."""

from __future__ import annotations

import ast
from typing import Any

from attnscope.usertrace.astreads import PRODUCTS, called, derived, is_layer, source_tree


def off_scores(node: ast.AST, combined: ast.BinOp | ast.AugAssign, parents: dict[ast.AST, ast.AST], forward: bool,
               owner: Any = None) -> str | None:
    """Where `combined`, the parameter's read `node` added to (or multiplied by) another tensor, goes where it is off
    the scores: its other operand is no attention weights (nothing a softmax made), and its result reaches no
    softmax: "added" where it is projected on some path (DETR's `self.q_proj(tgt + query_pos)`), "residual" where it
    is only returned (`residual + self.o_proj(out)`), "angles" where it only makes RoPE's angles (`step[..., None]
    * inv_freq`, then `.cos()`, `.sin()`: positions, no mask). None (on the scores, as before) on any other path: a
    helper's call, a library's function that may take the scores, and the return of a helper (`forward` False: the
    user's function the forward hands the parameter to, `def add(scores, bias): return scores + bias`), whose caller
    may take what it returns to the scores. `owner`: the module whose layers the code calls (`self.attend(dots)` is
    an nn.Softmax, `self.drop(..)` passes the value on, `self.q_proj(..)` projects it); a layer it cannot tell keeps
    the sum on the scores."""
    root: ast.AST = combined
    while root in parents:
        root = parents[root]
    weights = _softmaxed(root)
    other = combined.target if isinstance(combined, ast.AugAssign) else \
        combined.right if combined.left is node else combined.left
    if _weighs(other, weights) or _softmax_in(other):
        return None
    ends: set[str] = set()
    if isinstance(combined, ast.AugAssign):
        off = _names_off({n.id for n in ast.walk(combined.target) if isinstance(n, ast.Name)}, root, parents, ends,
                         owner, _end(combined))
    else:
        off = _flows_off(combined, root, parents, set(), ends, owner)
    return _kind(off, ends, forward)


def _kind(off: bool, ends: set[str], forward: bool) -> str | None:
    """What a value off the scores is, by where its paths end; "returned" where a helper returns it (its caller
    says where it goes: returned_off)."""
    if not off:
        return None
    if "returned" in ends and not forward:
        return "returned"
    return "added" if "projected" in ends else "residual" if "returned" in ends else "angles"


def returned_off(call: ast.AST, parents: dict[ast.AST, ast.AST], forward: bool, owner: Any = None) -> str | None:
    """Where the value a helper returned off the scores goes in its caller (`call`, the helper's call there):
    BLOOM's `dropout_add(out, residual, p, training)`, `out = dropout(x); return residual + out`, then returned by
    the forward, is a residual. None where it may reach the scores."""
    root: ast.AST = call
    while root in parents:
        root = parents[root]
    ends: set[str] = set()
    return _kind(_flows_off(call, root, parents, set(), ends, owner), ends, forward)


SOFTMAX_CALLS = ("softmax", "log_softmax", "exp", "exp_", "scaled_dot_product_attention", "masked_fill",
                 "masked_fill_", "where", "sigmoid")
PASSING = ("torch", "F", "math")  # a library's elementwise function passes the value on (`torch.tanh(x + pos)`)


def _softmax_in(expr: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and called(n) in SOFTMAX_CALLS for n in ast.walk(expr))


def _softmaxed(root: ast.AST) -> set[str]:
    """The names bound to what a softmax made, and to what is made of them, to a fixed point (the weights)."""
    names: set[str] = set()
    grown = True
    while grown:
        grown = False
        for node in ast.walk(root):
            if isinstance(node, ast.Assign) and (_softmax_in(node.value) or _weighs(node.value, names)):
                for n in (t for target in node.targets for t in ast.walk(target)):
                    if isinstance(n, ast.Name) and n.id not in names:
                        names.add(n.id)
                        grown = True
    return names


def _weighs(expr: ast.AST, names: set[str]) -> bool:
    """Whether `expr` holds the weights (a name of `names`) elementwise: not through a product (`a @ v`, a matmul,
    an einsum, a layer's call), which makes the attention's output of them."""
    inside = {child: node for node in ast.walk(expr) for child in ast.iter_child_nodes(node)}
    for n in ast.walk(expr):
        if not (isinstance(n, ast.Name) and n.id in names):
            continue
        parent = inside.get(n)
        while parent is not None:
            if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.MatMult) \
                    or isinstance(parent, ast.Call) and (called(parent) in PRODUCTS or is_layer(parent.func)):
                break
            parent = inside.get(parent)
        else:
            return True
    return False


def _layer(owner: Any, func: ast.AST) -> str | None:
    """What the module's own layer `self.<name>` does to what it reads: "softmax" (nn.Softmax, nn.LogSoftmax),
    "projects" (nn.Linear, a convolution, GPT-2's Conv1D), "passes" (torch's other layers: dropout, a norm, an
    activation, the identity); None where it cannot tell (a layer of the user's own, no module at hand)."""
    from torch import nn

    layer = getattr(owner, func.attr, None) if isinstance(func, ast.Attribute) else None
    if not isinstance(layer, nn.Module):
        return None
    if isinstance(layer, (nn.Softmax, nn.LogSoftmax, nn.Softmin)):
        return "softmax"
    if isinstance(layer, (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)) or type(layer).__name__ == "Conv1D":
        return "projects"
    return "passes" if type(layer).__module__.startswith("torch.nn.") else None


ANGLES = ("cos", "sin", "polar")  # RoPE's tables made of angles: what meets them is positions, never a mask


def _nested(node: ast.AST, root: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether `node` sits in a function defined inside the forward (or a lambda), not in the forward itself."""
    defs = 0
    while node in parents:
        node = parents[node]
        defs += isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    return defs > 1


def _operand(call: ast.Call, node: ast.AST) -> bool:
    """Whether `node` is the query, the key or the value of an attention kernel's call (its first three positional
    arguments, or `query=`, `key=`, `value=`), not its mask."""
    if node in call.args[:3]:
        return True
    return any(k.value is node and k.arg in ("query", "key", "value") for k in call.keywords)


def _flows_off(expr: ast.AST, root: ast.AST, parents: dict[ast.AST, ast.AST], seen: set[str], ends: set[str],
               owner: Any = None) -> bool:
    """Whether the value of `expr` reaches no softmax: every path from it ends in a layer's call or a `@` (a
    projection: "projected" added to `ends`) or the return ("returned")."""
    node, parent = expr, parents.get(expr)
    while parent is not None:
        if isinstance(parent, ast.Call):
            if node is parent.func:  # a method of the value's (`.float()`, `.repeat_interleave(2)`): passed on
                node, parent = parent, parents.get(parent)
                continue
            name = called(parent)
            if name in ANGLES:
                ends.add("angles")
                return True
            if name == "scaled_dot_product_attention" and _operand(parent, node):
                ends.add("projected")  # handed as q, k or v: multiplied into the scores, as `@` is
                return True
            if name in SOFTMAX_CALLS:
                return False
            if is_layer(parent.func):
                kind = _layer(owner, parent.func)
                if kind == "projects":
                    ends.add("projected")
                    return True
                if kind != "passes":
                    return False  # a softmax, or a layer that may be one
                node, parent = parent, parents.get(parent)
                continue
            func = parent.func
            library = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in PASSING
            if not library:
                return False  # a helper's or another call: it may take the scores
        elif isinstance(parent, ast.Attribute):
            if parent.attr in SOFTMAX_CALLS:
                return False
            if parent.attr in ANGLES:
                ends.add("angles")
                return True
            if parent.attr in PRODUCTS:
                ends.add("projected")
                return True
        elif isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.MatMult):
            ends.add("projected")
            return True
        elif isinstance(parent, ast.Return):
            if _nested(parent, root, parents):
                return False  # a function's own within the forward (a closure): its caller takes the value on
            ends.add("returned")
            return True
        elif isinstance(parent, ast.Assign):
            return _names_off({n.id for t in parent.targets for n in ast.walk(t) if isinstance(n, ast.Name)},
                              root, parents, ends, owner, _end(parent), seen)
        elif isinstance(parent, ast.stmt):
            return False
        node, parent = parent, parents.get(parent)
    return False


def _names_off(names: set[str], root: ast.AST, parents: dict[ast.AST, ast.AST], ends: set[str], owner: Any,
               after: tuple[int, int], seen: set[str] | None = None) -> bool:
    """`_flows_off` for every read of the names the value is bound to, after the statement that binds them (`after`:
    where it ends; a name read before is another value: `d = q.shape[-1]` before `q, k = rotated(q), rotated(k)`)."""
    seen = set() if seen is None else seen
    fresh = names - seen
    seen |= fresh
    reads = [n for n in ast.walk(root) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in fresh
             and (n.lineno, n.col_offset) >= after]
    return all(_flows_off(n, root, parents, seen, ends, owner) for n in reads)


def _end(node: ast.AST) -> tuple[int, int]:
    return getattr(node, "end_lineno", 0) or 0, getattr(node, "end_col_offset", 0) or 0


def added_to(fn: Any, name: str, first: str) -> bool:
    """Whether every `+` in the forward that reads `name` (or a name made of it alone) has `first` (the forward's
    input, or a name made of it alone) on its other side."""
    tree = source_tree(fn)
    if tree is None:
        return False
    mine, theirs = derived(tree, name), derived(tree, first)
    seen = False
    for node in ast.walk(tree):
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)):
            continue
        sides = [{n.id for n in ast.walk(side) if isinstance(n, ast.Name)} for side in (node.left, node.right)]
        for one, other in (sides, sides[::-1]):
            if one & mine:
                if not other & theirs:
                    return False
                seen = True
    return seen
