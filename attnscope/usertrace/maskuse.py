"""Which parameter is the mask, read from its use in a run, never from its name: the one a run handed the mask
applies to the attention's scores or weights (masked_fill, where, added to them, multiplying them, an attention
kernel's attn_mask), whatever it is called (`key_padding`, `pad`, `adj`, `valid`). What the code
makes of it alone on the way (a view, a cast, `~`, `1 - m`, a boolean mask of its own merged in) is followed; the
first op where it meets another tensor says: that tensor lies between the scores' product and the softmax (the
scores, masked or scaled), or after the softmax (the weights) before the product with the values. A parameter added
to the input, or multiplied into the queries, is no mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnscope.usertrace.align import ancestors
from attnscope.usertrace.kernels import ATTENTION_KERNELS
from attnscope.usertrace.masking import MERGING, SHAPED_ONLY
from attnscope.usertrace.record import MATMULS, SOFTMAXES

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record

PRODUCTS = (*MATMULS, "einsum")
# the ops that write a mask into a tensor the code made, as a bias: choose a number by it, or fill it where it says
WRITING = ("masked_fill", "masked_fill_", "where")
CONSTANTS = ("full", "zeros", "ones", "empty", "tensor")
# the ops that apply a mask to the scores or the weights: fill them, choose between them, add (or subtract) it, multiply
APPLYING = ("masked_fill", "masked_fill_", "__setitem__", "where", "add", "add_", "__add__", "__radd__", "__iadd__",
            "sub", "sub_", "__sub__", "__isub__", "subtract", "mul", "mul_", "__mul__", "__rmul__", "__imul__",
            "baddbmm")


def applied(records: list[Record], label: str) -> Record | None:
    """The op of the run that applies the parameter `label` to the scores or the weights, None where its first
    meeting with another tensor is with anything else (or it meets none)."""
    import torch

    derived: set[int] = set()  # records made of the parameter alone
    products = {r.index for r in records if r.func in PRODUCTS}
    softmaxes = {r.index for r in records if r.func in SOFTMAXES}
    above: dict[int, set[int]] = {}

    def lineage(index: int) -> set[int]:
        if index not in above:
            above[index] = ancestors(records[index], records) | {index}
        return above[index]

    for record in records:
        args = [a[1][1] if a[0] == "kw" else a for a in record.args]
        if not any(_reads(a, label, derived) for a in args):
            continue
        if record.func in ATTENTION_KERNELS or record.func == "multi_head_attention_forward":
            return record
        others = [value for kind, value in args if kind == "rec" and value not in derived]
        if not others:
            derived.add(record.index)
            continue
        if record.func in MERGING and all(records[i].tensor.dtype == torch.bool for i in others):
            derived.add(record.index)  # a mask of the code's own merged in: no scores met yet
            continue
        if record.func in WRITING and all(_constant(records[i]) for i in others):
            derived.add(record.index)  # a bias written from it into a tensor of one number (phi-1.5's MixFormer:
            continue  # full((b, s), -10000.0).masked_fill_(key_padding_mask, 0.0)), then met by the scores
        if record.func not in APPLYING:
            return None
        for other in others:
            seen = lineage(other)
            if _scores(seen, products, softmaxes, records) or _weights(seen, products, softmaxes):
                return record
        return None
    return None


def _constant(record: Record) -> bool:
    """Whether the code made `record` as a tensor of one number, of no input (torch.full, zeros, ones, new_full,
    zeros_like: a shape at most taken from another tensor)."""
    name = record.func.split(".")[-1]
    return name in SHAPED_ONLY or (name in CONSTANTS and not any(kind == "rec" for kind, _ in record.args))


def _reads(arg: Any, label: str, derived: set[int]) -> bool:
    kind, value = arg
    return (kind == "text" and value == label) or (kind == "rec" and value in derived)


def _scores(seen: set[int], products: set[int], softmaxes: set[int], records: list[Record]) -> bool:
    """Whether the tensor whose lineage is `seen` (itself last) is the scores: read by a softmax later, and made from
    the last product before that softmax (`q @ k.transpose(-2, -1)`, not a projection `x @ W` before it)."""
    own = max(seen)
    for s in softmaxes:
        before = ancestors(records[s], records)
        if own in before and before & products and max(before & products) in seen:
            return True
    return False


def _weights(seen: set[int], products: set[int], softmaxes: set[int]) -> bool:
    """Whether the tensor whose lineage is `seen` is a softmax's output (or made from it) before any product."""
    return bool(seen & softmaxes) and not any(p > max(seen & softmaxes) for p in seen & products)
