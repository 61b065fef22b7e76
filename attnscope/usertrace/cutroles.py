"""The roles the code's own words give the rows it cuts from a packed weight (weightrows.py) before projecting with
them: `w_q, w_k, w_v = in_proj_weight.chunk(3)`, `wq, wk, wv = torch.split(qkv.weight, sizes)`, `k = F.linear(key,
w[E:2 * E])`, or the place of the cut along a packed axis of 3 (`chunk(3)[1]`, `kernel[2]`).

The data flow reads each cut's role from its use (the scores' right operand is K, what the pattern multiplies V), and
weights alone cannot tell a layout from a swap. The words can, as for a fused projection's output (words.py): rows the
code names k and then uses as the values (`k, v = v, k` after the projections, `attn @ k`) are k and v swapped; the
reference then holds the rows by the words and the catalog names the swap by experiment. Where the words agree with
the use and the rows run in another order than q, k, v (`w_q, w_v, w_k = in_proj_weight.chunk(3)`), that order is a
layout of the weights, said in a note (order_note) as for a fused projection's output (fused.rows_note); stronger
where the packed weight is PyTorch's own `in_proj_weight`, whose order q | k | v is documented (DOCUMENTED)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from attnscope.usertrace import words

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record


def swapped(records: list[Record], found: dict[str, str]) -> str | None:
    """Where the flow's K and V (`found`: role -> weight name) are both rows the code cut from a packed weight and
    its words give the keys' rows to v and the values' to k: how they say so (fused.named_swapped's words); None
    where they agree with the use, say nothing, or the weights are no cuts."""
    from attnscope.usertrace.flow import operands
    from attnscope.usertrace.fused import named_swapped

    operand = operands(records)
    if operand is None:
        return None
    said: dict[str, words.Said | None] = {}
    for role, index in (("k", operand[1]), ("v", operand[2])):
        cut = _cut(records, found[role])
        if cut is None:
            return None
        said[role] = words.said(records, cut, index, "qkv")
    return named_swapped(said, "qkv")


# packed parameters whose row order is documented: nn.MultiheadAttention's, which F.multi_head_attention_forward
# (its `_in_projection_packed`: "packed along dimension 0, in q, k, v order") cuts `w_q, w_k, w_v = w.chunk(3)`
DOCUMENTED = {"in_proj_weight": "PyTorch's packed q | k | v parameter (nn.MultiheadAttention's, which "
                                "F.multi_head_attention_forward cuts w_q, w_k, w_v = in_proj_weight.chunk(3))"}


def order_note(linears: dict[str, tuple[str, Any]]) -> str | None:
    """Where q, k and v are all rows the code cut from one packed parameter (weightrows.py names each cut by its rows,
    `in_proj_weight[64:128]`, `W[1]`) in another order than q, k, v: the note saying that layout; None otherwise."""
    from attnscope.usertrace.fused import rows_note
    from attnscope.usertrace.weightrows import cut_rows

    cuts = {role: cut_rows(linears[role][0]) for role in "qkv" if role in linears}
    if len(cuts) < 3 or any(c is None for c in cuts.values()):
        return None
    bases = {c[0] for c in cuts.values() if c is not None}
    if len(bases) != 1:
        return None
    base = bases.pop()
    held = {role: list(range(c[1], c[2])) for role, c in cuts.items() if c is not None}
    leaf = base.rsplit(".", 1)[-1]
    documented = leaf in DOCUMENTED and all(c is not None and c[3] for c in cuts.values())  # runs of rows, not [i]
    said = rows_note(base, held, codegen=not documented)
    if said is None or not documented:
        return said
    order = ", ".join(sorted(held, key=lambda role: held[role][0]))
    return (f"{base}'s rows hold {order}, as your code reads them; but {leaf} is {DOCUMENTED[leaf]}: weights "
            "nn.MultiheadAttention saved, loaded into your module, would be read in another order (k and v "
            "swapped where yours hold q, v, k). Your code agrees with itself (each part used as it is named), and "
            "trained in this layout it is right, so trace names no mistake: check the order your weights were "
            "saved in")


def _cut(records: list[Record], name: str) -> Record | None:
    """The record that cut the rows the projection `name` uses out of its packed weight (the chunk, split or index,
    above the views the code took of the rows before projecting: `w_q.T`); None where `name` is no cut."""
    made = next((r.details["weight_record"] for r in records if r.style == "linear" and r.args
                 and r.args[0] == ("text", name) and "weight_record" in r.details), None)
    if made is None:
        return None
    cut = records[made]
    while cut.parents and records[cut.parents[0]].tensor.numel() == cut.tensor.numel():
        cut = records[cut.parents[0]]  # a whole view of the rows (w_q.T, w_k.float()): the cut is above it
    whole = records[cut.parents[0]].tensor.numel() if cut.parents else math.prod(cut.details.get("source_shape", ()))
    return cut if cut.tensor.numel() < whole else None
