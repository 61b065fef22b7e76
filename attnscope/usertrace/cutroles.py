"""The roles the code's own words give the rows it cuts from a packed weight (weightrows.py) before projecting with
them: `w_q, w_k, w_v = in_proj_weight.chunk(3)`, `wq, wk, wv = torch.split(qkv.weight, sizes)`, `k = F.linear(key,
w[E:2 * E])`, or the place of the cut along a packed axis of 3 (`chunk(3)[1]`, `kernel[2]`).

The data flow reads each cut's role from its use (the scores' right operand is K, what the pattern multiplies V), and
weights alone cannot tell a layout from a swap. The words can, as for a fused projection's output (words.py): rows the
code names k and then uses as the values (`k, v = v, k` after the projections, `attn @ k`) are k and v swapped; the
reference then holds the rows by the words and the catalog names the swap by experiment."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

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
