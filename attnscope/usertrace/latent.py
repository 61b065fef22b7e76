"""Multi-head latent attention (DeepSeek-V2/V3's MLA, MiniCPM3's, Kimi's) read off the data flow, to be said in one
line rather than misread as four projections.

MLA's signature, whatever its layers are called: one Linear (`kv_b_proj`, `wkv_b`) expands both the keys and the
values from what another of the module's Linear layers wrote (`kv_a_proj_with_mqa`, `wkv_a`: the compressed
latent, normed on its way), and the keys also take a part straight from that first Linear, past the expansion (the
rotary key part every head shares). Such a module's reference is attnscope's LatentAttention (usertrace/latentref.py),
not MultiHeadAttention, whose keys and values are each one projection of the input; where that one cannot be built,
the module is refused in one line with what reads it instead: attnscope's DeepSeek page for a model folder, or
`attnscope mha --kv-lora-rank` for latent attention of random weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnscope.errors import UsageError
from attnscope.usertrace import flow
from attnscope.usertrace.align import ancestors

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record


def expansion(records: list[Record]) -> tuple[str, str, int] | None:
    """(the latent's Linear, the Linear that expands keys and values from it, the latent's width) where the data flow
    is MLA's: the keys and the values both come from one Linear fed by another of the module's, and the keys also
    read that other Linear's output past the expansion. None otherwise."""
    found = flow.operands(records)
    if found is None:
        return None
    _, right, value, _ = found
    made, linears = flow.linears_of(records)
    keys = ancestors(records[right], records) | {right}
    users: dict[int, set[int]] = {}  # each record's consumers on the keys' way
    for r in records:
        if r.index in keys:
            for p in r.parents:
                users.setdefault(p, set()).add(r.index)
    for record in records:
        up = made.get(record.index)
        if up is None or up not in linears[right] or up not in linears[value]:
            continue
        fed = [p for p in record.parents if p not in made or made[p] != up]
        feeding = set().union(*(linears[p] for p in fed)) - {up} if fed else set()
        into = set().union(*(ancestors(records[p], records) | {p} for p in fed)) if fed else set()
        for latent in sorted(feeding, key=lambda name: min(i for i, n in made.items() if n == name)):
            # read past the expansion: on the keys' way through something other than a call of it (MLA's k_pe,
            # split from the latent's output and rotated); a second call of a LoRA adapter's down-projection, whose
            # every use is its up-projection (Zamba2's adapters on the keys and the values), is none
            past = [i for i in keys - {right} if latent in linears[i] and up not in linears[i] and i not in into
                    and any(made.get(u) != up for u in users.get(i, ()))]
            if past:
                width = max((records[p].tensor.shape[-1] for p in fed if records[p].tensor.dim()), default=0)
                return latent, up, int(width)
    return None


def refusal(records: list[Record], name: str) -> UsageError | None:
    """The one-line refusal of an MLA module `name` (its class), or None where the flow is not MLA's."""
    found = expansion(records)
    if found is None:
        return None
    latent, up, width = found
    return UsageError(
        f"{name} is multi-head latent attention (DeepSeek-V2/V3's MLA, read from the data flow: {up} expands every "
        f"head's keys and values from a latent of {width} numbers a token that {latent} writes, and the keys take a "
        f"part of {latent}'s output past it), whose reference trace builds for self-attention (in a decode step, "
        "where its code keeps every head's keys and values expanded), not the column form, its head count known "
        "(--heads), and its query, latent and output layers read from the flow; "
        "for a DeepSeek checkpoint run `attnscope head --model FOLDER` (docs/models.md), for MLA of random weights "
        "`attnscope mha --kv-lora-rank R`")
