"""The polarity a module's own default mask gives its mask parameter, where its ops read the other.

AllenNLP's MultiHeadSelfAttention makes `mask = inputs.new_ones(batch_size, timesteps)` when it is given none: a
mask of all True, meaning "no padding", so True means "may attend". Code that then applies it as
`masked_fill(mask, min)` (True = masked out) would mask every key of its own default: its ops read the mask the
other way round from the convention the module's own default holds. Read from the run, never from names: in a run
given no mask, the op that applies the mask (the one masking.detect read, on its line) reads a tensor made from a
constant alone (`new_ones`, `ones`, `full`, `new_zeros`, ..., then viewed, repeated, cast), every cell of it one
value; where the ops' polarity masks every key at that value, the module's default is the other polarity (its
caller's convention), and the mask is given so, as where the code's own words say it (statedmask.py): the run then
shows what the code does with it (`mask.polarity`, by experiment).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record

CONSTANTS = ("new_ones", "ones", "ones_like", "new_full", "full", "full_like", "new_zeros", "zeros", "zeros_like")
KEPT = ("view", "reshape", "repeat", "expand", "unsqueeze", "squeeze", "bool", "float", "to", "type", "long", "int",
        "contiguous", "repeat_interleave", "flatten", "unflatten", "transpose", "permute", "expand_as", "clone",
        "__getitem__", "getitem", "__invert__", "logical_not", "bitwise_not", "__eq__", "eq", "__ne__", "ne")


def default_masks_all(records: list[Record], line: int | None, kind: str) -> Record | None:
    """In a run given no mask, the constant the code made for its mask (its own default), where the op on `line`
    that applies the mask (its boolean polarity `kind`, 'attend' or 'masked') reads a tensor made of that constant
    alone, one value in every cell, and masks every key with it; None otherwise."""
    from attnscope.usertrace.align import ancestors

    if line is None or kind not in ("attend", "masked"):
        return None
    for record in records:
        if record.line != line or not (record.func.startswith("masked_fill") or record.func == "where"):
            continue
        at = 1 if record.func.startswith("masked_fill") else 0
        arg = record.args[at] if len(record.args) > at else ("", None)
        if arg[0] != "rec" or not isinstance(arg[1], int):
            continue
        operand = records[arg[1]]
        made = ancestors(operand, records) | {operand.index}
        if any(records[i].func not in CONSTANTS + KEPT for i in made):
            continue  # made from the inputs or the scores too: no default of the code's own
        constant = next((records[i] for i in sorted(made) if records[i].func in CONSTANTS), None)
        values = operand.tensor.reshape(-1)
        if constant is None or values.numel() == 0 or not bool((values == values[0]).all()):
            continue
        # masked_fill(m, fill) fills where m is True; where(m, scores, fill) keeps where m is True, where(m, fill,
        # scores) fills there
        keeps = record.func == "where" and len(record.args) > 2 and record.args[1][0] == "rec" \
            and record.args[2][0] != "rec"
        masks_all = bool(values[0]) != keeps
        return constant if masks_all else None
    return None
