"""ALiBi handed in: a forward that takes ALiBi's bias as an argument its model built (BLOOM's `alibi`, MPT's
`position_bias`, llm-foundry's `attn_bias`) gets, under --alibi, the reference's ALiBi in the layout the code reads.

The layouts models build it in (FORMS), each tried in turn by runs/trace_attempt.py; the code keeps the first under
which it runs and, where several run, lines up furthest with the reference:
- `[n_batch·n_head, 1, n_K]`: BLOOM's `build_alibi_tensor`, used as `alibi.baddbmm(q, kᵀ, beta=1, alpha=1/√d)` over
  the heads folded into the batch (Falcon's old alibi too);
- `[n_head, 1, n_K]`: transformers' `build_mpt_alibi_tensor`, sliced `position_bias[:, :, -n_K:]` and added to
  `[n_batch, n_head, n_Q, n_K]` scores;
- `[1, n_head, 1, n_K]`, `[n_batch, n_head, 1, n_K]`: llm-foundry's `attn_bias`, added after a 4-axis slice;
- `[n_head, n_Q, n_K]`, `[n_batch, n_head, n_Q, n_K]`: a bias per query row (Baichuan-13B's).

The values are the reference's own, `−m_h · (i + offset − j)` with ALiBi's slopes for the run's head count
(attnscope.variants.alibi), the queries placed last (offset n_K − n_Q). A one-row layout holds the last query's
row, `m_h · (j − n_K + 1)` (MPT's): it differs from each row's bias by a constant per row, which the softmax takes
out and the line-up reads as a convention (docs/trace.md, "Biases, qk-norm and the scale"), as BLOOM's `m_h · j`.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.usertrace.astreads import source_tree

if TYPE_CHECKING:
    import torch

    from attnscope.usertrace.load import Plan

# layout -> its dims, in the order tried: the one-row layouts first (the models that pass ALiBi in build them so)
FORMS: dict[str, tuple[str, ...]] = {
    "folded": ("n_batch·n_head", "1", "n_K"), "heads": ("n_head", "1", "n_K"),
    "heads, 4 axes": ("1", "n_head", "1", "n_K"), "batched": ("n_batch", "n_head", "1", "n_K"),
    "rows": ("n_head", "n_Q", "n_K"), "rows, batched": ("n_batch", "n_head", "n_Q", "n_K")}
FIRST = next(iter(FORMS))
# the words of a bias to the scores that, under --alibi, is ALiBi's (load.is_alibi: a parameter named for ALiBi)
BIAS_WORDS = ("position_bias", "pos_bias", "attn_bias", "attention_bias", "rel_bias")


def told(plan: Plan, fn: Any = None) -> Plan:
    """`plan` under --alibi: a position bias (MPT's `position_bias`), else a bias parameter read as a mask and not
    named one (llm-foundry's `attn_bias`), else a required tensor after the input that the code adds to its scores
    or hands to `baddbmm` as the term it adds (read from its use, whatever its name), takes ALiBi's bias when the
    plan has no ALiBi parameter of its own; the first layout to try set (runs/trace_attempt.py reads the one the
    code runs on)."""
    if plan.alibi is not None:
        if _builds_own(fn, plan.alibi):
            return plan
        return dataclasses.replace(plan, alibi_form=plan.alibi_form or FIRST)
    used = [n for n in plan.tensors[1:] if fn is not None and _on_scores(fn, n)]
    if plan.bias is None and used:
        return dataclasses.replace(plan, alibi=used[0], alibi_required=True, alibi_form=FIRST,
                                   tensors=[n for n in plan.tensors if n != used[0]])
    if plan.bias is not None:
        if _builds_own(fn, plan.bias):
            return plan
        return dataclasses.replace(plan, alibi=plan.bias, alibi_required=plan.bias_required, bias=None,
                                   bias_required=False, alibi_form=FIRST)
    named = [m for m in ([plan.mask] if plan.mask else []) + plan.other_masks
             if any(w in m.lower() for w in BIAS_WORDS) and "mask" not in m.lower()]
    own = [m for m in named if _builds_own(fn, m)]
    if own:  # the module makes ALiBi itself where it gets none: it gets None, and its own bias is compared
        others = [m for m in plan.other_masks if m not in own]
        mask = plan.mask if plan.mask not in own else (others[0] if others else None)
        plan = dataclasses.replace(plan, mask=mask, other_masks=[m for m in others if m != mask],
                                   nones=[*(n for n in plan.nones if n != mask), *(m for m in own
                                                                                   if m not in plan.nones)])
    biased = [m for m in named if m not in own]
    if not biased:
        return plan
    name = biased[0]
    others = [m for m in plan.other_masks if m != name]
    mask = plan.mask if plan.mask != name else (others[0] if others else None)
    return dataclasses.replace(plan, alibi=name, alibi_form=FIRST, mask=mask,
                               other_masks=[m for m in others if m != mask],
                               nones=[n for n in plan.nones if n != name and n != mask])


def _builds_own(fn: Any, name: str) -> bool:
    """Whether `name` has a default and the forward makes its own bias when it is left out: an assignment to it
    that does not read it (llm-foundry's `if attn_bias is None: attn_bias = self._attn_bias(...)`, the module's own
    ALiBi, which is then the code's to compare, and a mistake in it is named). A reassignment that reads it
    (MPT's `position_bias = position_bias[:, :, -n_K:]`) is no bias of its own."""
    import inspect

    if fn is None:
        return False
    try:
        parameter = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return False
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return False
    tree = _tree(fn)
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and not any(
                isinstance(n, ast.Name) and n.id == name for n in ast.walk(value)):
            return True
    return False


def _checks_none(fn: Any, name: str) -> bool:
    """Whether the forward asks `name is None` (or `is not None`): None is then a value it takes, its own switch
    (Falcon's `alibi`, positional without a default, None in its RoPE models: `if alibi is None:` rotates)."""
    tree = _tree(fn) if fn is not None else None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            sides = [node.left, *node.comparators]
            if any(isinstance(n, ast.Name) and n.id == name for n in sides) and any(
                    isinstance(n, ast.Constant) and n.value is None for n in sides):
                return True
    return False


def _tree(fn: Any) -> ast.AST | None:
    return source_tree(fn)


def _on_scores(fn: Any, name: str) -> bool:
    """Whether the code adds `name` to its scores (maskroles.role) or calls `name.baddbmm(q, kᵀ)` /
    `torch.baddbmm(name, q, kᵀ)` (BLOOM's scores with the bias in one op)."""
    from attnscope.usertrace import maskroles

    if maskroles.role(fn, name) == "mask":
        return True
    tree = _tree(fn)
    for node in ast.walk(tree) if tree is not None else ():
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ADDED_IN_ONE_OP):
            continue
        first = node.func.value if not _library(node.func.value) else (node.args[0] if node.args else None)
        if isinstance(first, ast.Name) and first.id == name:
            return True
    return False


# the ops that add their first operand to a product of the next two (BLOOM's alibi.baddbmm(q, kᵀ, beta=1))
ADDED_IN_ONE_OP = ("baddbmm", "addbmm", "addmm")


def _library(value: ast.AST) -> bool:
    return isinstance(value, ast.Name) and value.id in ("torch", "F")


def untold(plan: Plan, fn: Any = None) -> Plan:
    """`plan` without --alibi: an ALiBi parameter without a default that the forward tests for None (Falcon's
    `alibi`, None in its RoPE models) is given None, its own switch, and not refused."""
    if plan.alibi is not None and plan.alibi_required and _checks_none(fn, plan.alibi):
        return dataclasses.replace(plan, alibi_required=False)
    return plan


def refusal(plan: Plan) -> str | None:
    """The one line for code that takes ALiBi's bias as an argument without a default, run without --alibi."""
    if plan.alibi is None or plan.alibi_form or not plan.alibi_required:
        return None
    return (f"{plan.alibi}: your code adds ALiBi's bias, handed in by its model, to its scores; pass --alibi (trace "
            "then hands it the reference's, in the layout your code reads)")


def made(form: str, sizes: dict[str, int], dtype: torch.dtype) -> tuple[torch.Tensor, tuple[str, ...], str]:
    """ALiBi's bias laid out as `form`, its dims and the note on the input."""
    from attnscope.variants import alibi

    n_head, n_Q, n_K, n_batch = sizes.get("n_head", 1), sizes["n_Q"], sizes["n_K"], sizes.get("n_batch", 1)
    m = alibi.slopes(n_head)
    bias = alibi.bias(n_head, n_Q, n_K, n_K - n_Q, given=m).to(dtype)  # [n_head, n_Q, n_K]
    dims = FORMS[form]
    one_row = "n_Q" not in dims
    laid: torch.Tensor = bias[:, -1:] if one_row else bias
    if dims[0] == "n_batch" or dims[0] == "n_batch·n_head":
        laid = laid.expand(n_batch, *laid.shape)
    laid = laid.reshape(tuple(_size(d, sizes) for d in dims)).contiguous()
    slopes = ", ".join(f"{s:.4g}" for s in m[:4].tolist()) + (", ..." if n_head > 4 else "")
    said = ("m_h · (j − n_K + 1), one row for every query (differs from −m_h · (i − j) by a constant per row)"
            if one_row else "−m_h · (i − j), the queries last")
    return laid, dims, f"input: ALiBi's bias (--alibi), {said}, slopes {slopes}"


def _size(dim: str, sizes: dict[str, int]) -> int:
    if dim == "1":
        return 1
    if dim == "n_batch·n_head":
        return sizes.get("n_batch", 1) * sizes.get("n_head", 1)
    return sizes.get(dim, 1)


def note(name: str, form: str) -> str:
    """What the run's note says the parameter was given."""
    return (f"{name}: given ALiBi's bias (--alibi) as [{', '.join(FORMS[form])}], the reference's slopes: of the "
            f"layouts models hand it in ({len(FORMS)} tried, alibifeed.py), the first your code runs on and lines up "
            "with")


def feed(plan: Plan, sizes: dict[str, int], dtype: torch.dtype) -> tuple[Any, tuple[str, ...], str] | None:
    """What the ALiBi parameter gets: the bias in the plan's layout under --alibi, None where it has a default;
    refused in one line where it has none and --alibi was not given."""
    if plan.alibi is None:
        return None
    line = refusal(plan)
    if line is not None:
        raise UsageError(line)
    if not plan.alibi_form:
        return None
    return made(plan.alibi_form, sizes, dtype)
