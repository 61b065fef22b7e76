"""A projection applied once the heads are split: one `Linear(d_head, d_head)` every head shares (Persson's 2020
`SelfAttention`: `values = self.values(values.reshape(N, n, heads, head_dim))`), or an einsum of a weight
`[d_head, d_head]` (`'bnhd,de->bnhe'`) or of one block per head (`'bnhd,hde->bnhe'`, `[n_head, d_head, d_head]`).

Read from the data flow: every call of the projection reads a tensor with a head axis (n_head long, before its last)
that only rearranging ops (view, reshape, transpose, permute, ...) made from a tensor n_head·d_in wide (the module's
input, or one the code made). Head h's slice of that width is projected by the weight alone (or by block h), so the
projection of the whole width is block-diagonal: the reference holds it so (`torch.block_diag` of the weight once a
head, its bias once a head), the queries it writes split into heads as the reference splits them, and the module
reads as multi-head attention of d_feat = n_head·d_in, a convention said in a note.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace.fused import Part

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record


@dataclass
class Blocks(Part):
    """A projection each head applies to its own slice, held as one block-diagonal weight."""

    heads: int = 1
    shared: bool = True  # one weight every head applies (else a block of its own per head)
    block: tuple[int, int] = (0, 0)  # a block's [d_out, d_in]


def spread(name: str, linear: Any, records: list[Record], n_head: int | None) -> Any:
    """`linear` as the block-diagonal projection of the full width, where every call of it reads the heads'
    slices (`[.., n_head, .., d_in]`, rearranged from a tensor n_head·d_in wide); `linear` itself otherwise."""
    from attnscope.usertrace.align import REARRANGING

    weight = getattr(linear, "weight", None)
    calls = [r for r in records if r.style == "linear" and r.args and r.args[0] == ("text", name)]
    if not calls or n_head is None or n_head < 2 or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return linear
    d_out, d_in = (int(n) for n in weight.shape)
    widths = {int(r.tensor.shape[-1]) for r in calls}
    for call in calls:
        given = next((v for k, v in call.args[1:] if k == "rec"), None)
        if given is None:
            return linear
        x = records[given].tensor
        if x.dim() < 3 or x.shape[-1] != d_in or n_head not in tuple(x.shape[:-1]) \
                or not _split(records, records[given], n_head * d_in, REARRANGING):
            return linear
    if len(widths) != 1:
        return linear
    width = widths.pop()  # what a head's block writes
    bias = getattr(linear, "bias", None)
    bias = bias.detach() if isinstance(bias, torch.Tensor) else None
    if width == d_out:  # one weight every head shares
        blocks, shared = [weight.detach()] * n_head, True
        bias = bias.repeat(n_head) if bias is not None else None
    elif width * n_head == d_out:  # a block of its own for each head ([n_head, d_in, d_head] read 'bnhd,hde->bnhe')
        blocks, shared = list(weight.detach().split(width)), False
    else:
        return linear
    return Blocks(name, torch.block_diag(*blocks), bias, heads=n_head, shared=shared, block=(width, d_in))


def _split(records: list[Record], record: Record, wide: int, rearranging: tuple[str, ...]) -> bool:
    """Whether only rearranging ops made `record` from a tensor `wide` features wide (an input of the module, or a
    tensor the code made)."""
    while record.func in rearranging:
        if not record.parents:
            source = record.details.get("source_shape") or (0,)
            return int(source[-1]) == wide
        record = records[record.parents[0]]
        if int(record.tensor.shape[-1]) == wide:
            return True
    return False


def note(linears: dict[str, tuple[str, Any]]) -> str | None:
    """The note a reading holding block-diagonal projections says; None where it holds none."""
    held = [(name, part) for name, part in linears.values() if isinstance(part, Blocks)]
    if not held:
        return None
    names = [name for name, _ in held]
    who = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    part = held[0][1]
    how = "one weight the heads share" if all(p.shared for _, p in held) else \
        "a block of its own for each head" if not any(p.shared for _, p in held) else "its weights"
    return (f"{who} project{'s' if len(names) == 1 else ''} each head's slice ({part.block[1]} features) after the "
            f"split, with {how}: the reference holds {'it' if len(names) == 1 else 'each'} as one block-diagonal "
            f"projection of the whole width ({part.heads} blocks, [{part.out_features}, {part.in_features}]), a "
            "convention, not a mistake")
