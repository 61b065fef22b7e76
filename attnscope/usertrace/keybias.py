"""A fused projection's bias the code builds in blocks, one of them a constant zero: BEiT's, Swin v2's and
data2vec's `torch.cat((q_bias, torch.zeros_like(v_bias), v_bias))`, EVA's zero buffer `k_bias`, a block of
`new_zeros` beside chunks of a learned `qkv_bias`.

Such a block is the keys', by the module's own say. A bias on the keys adds q·b_k to every score of a query's
row, the same for every key, which the softmax cancels; so these models learn none there, while a bias on the
values moves the output. Code that reads the zero block as its values and a learned one as its keys swaps k and
v, whatever order its weight's rows are in (fused.solve_rows then holds the rows as the bias says, and the
catalog names the swap by experiment); a fused weight whose blocks are otherwise alike says nothing, and any
order of its rows is a layout of the weights. Separate Linear layers whose names say no role (a ModuleList, `lin1`,
`lin2`) say it the same way: one built with `bias=False` beside biased ones (Whisper's and data2vec's keys) is the
keys' (biased_swap).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from attnscope.usertrace.masking import SHAPED_ONLY

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record

CATS = ("cat", "concat", "concatenate")
ADDS = ("add", "__add__", "__radd__")
LEARNED, ZERO, OTHER = 1, 0, -1


class Zero(NamedTuple):
    """The rows of a fused projection's bias that the code holds at a constant zero, and those it learns."""

    zero: torch.Tensor  # bool [width]: a constant zero the code makes (zeros_like, torch.zeros, a zero buffer)
    learned: torch.Tensor  # bool [width]: read from a parameter
    line: int
    what: str  # what makes the zero block, as the code writes it


def zero_rows(module: Any, records: list[Record], name: str) -> Zero | None:
    """The bias rows of the fused projection `name` (its weight's name as the records write it) that the code makes
    a constant zero beside learned ones; None where its one call has no bias built in blocks, or no zero block."""
    made = [r for r in records if r.style == "linear" and r.args and r.args[0] == ("text", name)]
    if len(made) != 1 or not isinstance(module, torch.nn.Module):
        return None
    arg = _bias_of(made[0], records)
    if arg is None:
        return None
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    found = _states(arg, records, params, buffers, made[0].line)
    if found is None:
        return None
    states, where = found
    if where is None or not bool((states == LEARNED).any()):
        return None
    return Zero(states == ZERO, states == LEARNED, *where)


def _bias_of(projection: Record, records: list[Record]) -> tuple[str, Any] | None:
    """The bias argument of a projection: F.linear's (addmm's) `bias`, or what the code adds to its output."""
    for kind, value in projection.args:
        if kind == "kw" and value[0] == "bias":
            return value[1]
    for r in records[projection.index + 1:]:
        if r.func in ADDS and ("rec", projection.index) in r.args and len(r.args) == 2:
            return next(a for a in r.args if a != ("rec", projection.index))
    return None


def _states(arg: tuple[str, Any], records: list[Record], params: dict[str, Any], buffers: dict[str, Any],
            line: int) -> tuple[torch.Tensor, tuple[int, str] | None] | None:
    """Each value of a bias as LEARNED, ZERO (a constant zero) or OTHER, flattened; and the first zero block's line
    and text. None where its size cannot be read."""
    from attnscope.usertrace.record import render_op

    kind, value = arg
    if kind == "text" and value in params:
        return torch.full((params[value].numel(),), LEARNED, dtype=torch.int8), None
    if kind == "text" and value in buffers:
        held = buffers[value]
        if held.is_floating_point() and bool((held == 0).all()):
            return torch.full((held.numel(),), ZERO, dtype=torch.int8), (line, f"the buffer {value}, all zeros")
        return torch.full((held.numel(),), OTHER, dtype=torch.int8), None
    if kind != "rec":
        return None
    record = records[value]
    tensor = record.tensor
    if record.func in CATS and tensor.dim() == 1 and record.args and record.args[0][0] == "list":
        pieces = [_states(a, records, params, buffers, record.line) for a in record.args[0][1]]
        if any(p is None for p in pieces):
            return None
        whole = torch.cat([p[0] for p in pieces if p is not None])
        where = next((p[1] for p in pieces if p is not None and p[1] is not None), None)
        return (whole, where) if whole.numel() == tensor.numel() else None
    if _reads_parameters(record.index, records, params):
        return torch.full((tensor.numel(),), LEARNED, dtype=torch.int8), None
    if tensor.is_floating_point() and bool((tensor == 0).all()):
        text = render_op(record.call, record.style, record.args, lambda i: records[i].label)
        return torch.full((tensor.numel(),), ZERO, dtype=torch.int8), (record.line, text)
    return torch.full((tensor.numel(),), OTHER, dtype=torch.int8), None


def _reads_parameters(index: int, records: list[Record], params: dict[str, Any]) -> bool:
    """Whether record `index`'s values are read from a parameter, directly or through other records (a
    `zeros_like(v_bias)` reads v_bias's shape alone, none of its values)."""
    seen, stack = set(), [index]
    while stack:
        i = stack.pop()
        if i in seen or records[i].func in SHAPED_ONLY:
            continue
        seen.add(i)
        for kind, value in records[i].args:
            if kind == "kw":
                kind, value = value[1]
            items = value if kind == "list" else [(kind, value)]
            for k, v in items:
                if k == "rec":
                    stack.append(v)
                elif k == "text" and v in params:
                    return True
    return False


def biased_swap(found: dict[str, str], modules: dict[str, Any], role_of: Any) -> tuple[dict[str, str], str] | None:
    """{role: Linear name} with k and v exchanged, and how, where the data flow reads the Linear without a bias as
    V and one with a bias as K, and neither's name says a role (names decide where they do); None otherwise."""
    k, v = found["k"], found["v"]
    if role_of(k) is not None or role_of(v) is not None:
        return None
    if getattr(modules[k], "bias", None) is None or getattr(modules[v], "bias", None) is not None:
        return None
    return ({**found, "k": v, "v": k},
            f"data flow, and k and v as their biases give them: {v} has none, as the keys' projection (whose bias a "
            f"softmax cancels) in Whisper and data2vec, and {k} one, which your code uses the other way round")
