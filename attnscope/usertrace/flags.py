"""A forward's required flags: parameters without a default that the code reads as a truth value, never as a tensor.

HF SqueezeBert's `forward(hidden_states, attention_mask, output_attentions)` takes `output_attentions` positionally,
with no default, and reads it only as `if output_attentions:`; a required `use_cache`, `return_weights` or
`is_causal` handed on to another call is the same kind. Fed a tensor, such a parameter was read as a second input
(cross-attention) and the code raised on `if <tensor>:`. It is given False, the value that makes the code return its
output alone (no weights, no cache).

Read from the forward's own source (its AST), never from the name alone: a parameter is a flag where the code reads
it only as a truth value (`if flag:`, `not flag`, `a if flag else b`, `flag and ...` under a test, `bool(flag)`,
`flag is True`) or hands it on unread (an argument of another call, a value kept or returned), and at least one
of those is a truth test or its name says it is a flag (FLAG_PREFIXES). Any other read (`flag.shape`, `flag[0]`,
`flag + 1`, `flag @ W`) makes it a tensor. The first input is never a flag.
"""

from __future__ import annotations

import ast
import inspect
from typing import TYPE_CHECKING, Any

from attnscope.usertrace.astreads import source_tree

if TYPE_CHECKING:
    from attnscope.usertrace.load import Plan

# the words transformers', fairseq's and timm's flags begin with (output_attentions, use_cache, return_dict,
# is_causal, need_weights): the name says flag where the code only hands the parameter on
FLAG_PREFIXES = ("output_", "use_", "return_", "is_", "need_", "has_", "do_", "with_")
TESTS = (ast.If, ast.While, ast.IfExp, ast.Assert)


def read(fn: Any, names: list[str]) -> list[str]:
    """Of the required parameters `names` (the first of them the input, never a flag), those the forward `fn` reads
    as a flag (the module docstring); none where its source cannot be read."""
    tree = source_tree(fn)
    if tree is None:
        return []
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    uses: dict[str, list[str]] = {name: [] for name in names[1:]}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in uses:
            uses[node.id].append(_use(node, parents))
    return [name for name, kinds in uses.items() if "value" not in kinds
            and ("truth" in kinds or name.lower().startswith(FLAG_PREFIXES))]


def as_flags(plan: Plan, fn: Any) -> Plan:
    """`plan` with the forward's required flags given False, no longer inputs, and a note that says so; its mask
    parameter given a mask that masks nothing where the code cannot run on None (`mask_needed`)."""
    import dataclasses

    found = read(fn, plan.tensors)
    if found:
        plan = dataclasses.replace(plan, tensors=[n for n in plan.tensors if n not in found], flags=found,
                                   said={**plan.said, found[0]: note(found)})
    return dataclasses.replace(plan, mask_open=True) if plan.mask and mask_needed(fn, plan.mask) else plan


def mask_needed(fn: Any, name: str) -> bool:
    """Whether the forward `fn` takes its mask parameter `name` with no default and reads it only as a tensor (HF
    SqueezeBert's `attention_score + attention_mask`, no `if attention_mask is not None`): None, trace's mask where
    none is asked for, is then a value it cannot run on, and a mask that masks nothing is what its callers hand
    it; the helpers of the user's own it hands the mask to are read too (maskroles.needed). Not where the code tests
    it for None or its truth, or hands it on to a call that is not the user's (that may)."""
    try:
        if inspect.signature(fn).parameters[name].default is not inspect.Parameter.empty:
            return False
    except (TypeError, ValueError, KeyError):
        return False
    from attnscope.usertrace import maskroles

    return maskroles.needed(fn, name)


def note(names: list[str]) -> str:
    """What the flags were given, and why."""
    return (f"{', '.join(f'{n} = False' for n in names)}: your code reads {'it' if len(names) == 1 else 'them'} as "
            "a flag (a truth value, never a tensor), so the call returns its output alone")


def _use(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    """How the code reads the name `node`: "truth" (a test of its truth), "on" (handed on unread: an argument of
    another call, a value kept, returned or chosen between) or "value" (any other read: a tensor's)."""
    parent = parents.get(node)
    if isinstance(parent, TESTS) and parent.test is node:  # type: ignore[attr-defined]
        return "truth"
    if isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not):
        return "truth"
    if isinstance(parent, ast.BoolOp):  # `flag and x is not None`: a test where the whole is one
        return "truth" if _use(parent, parents) == "truth" else "on"
    if isinstance(parent, ast.Call) and node in parent.args:
        return "truth" if isinstance(parent.func, ast.Name) and parent.func.id == "bool" else "on"
    if isinstance(parent, ast.Compare):
        others = [parent.left, *parent.comparators]
        constants = [o.value for o in others if o is not node and isinstance(o, ast.Constant)]
        if constants and all(c is None or isinstance(c, bool) for c in constants) \
                and all(isinstance(op, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)) for op in parent.ops):
            return "truth" if any(isinstance(c, bool) for c in constants) else "on"
        return "value"
    if isinstance(parent, (ast.keyword, ast.Assign, ast.AnnAssign, ast.Return, ast.Tuple, ast.List, ast.Dict)) or \
            isinstance(parent, ast.IfExp) and parent.test is not node:
        return "on"
    return "value"
