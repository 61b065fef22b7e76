"""--train: the user's dropout, read off their tensors and applied to the reference, so that the steps after it
can still be compared and the first real divergence found.

In training mode a dropout zeroes entries at random and scales the rest by 1/(1-p). Where the user's dropout
input equals the reference's `attention` (its softmax, the usual place: the Annotated Transformer's and
nanoGPT's `attn_dropout`), the multiplier it applied (`after / before`: 0 or 1/(1-p) per entry) is read from
the two recorded tensors and applied to the reference's attention; the steps after it (`x_raw ... x`, or
`out`) are computed again from that. A dropout elsewhere (on the output, nanoGPT's `resid_dropout`) changes
nothing the reference compares before it. `F.scaled_dot_product_attention(dropout_p=...)` drops inside its
kernel, where the mask cannot be read; diagnose.py says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from attnscope.trace import Trace
from attnscope.usertrace.align import compare

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record


def with_users_dropout(trace: Trace, records: list[Record], reference: Any) -> tuple[Trace | None, str] | None:
    """The reference with the user's attention dropout applied after `attention` (no trace when there is none
    to apply: the steps before the dropout are still compared), and a note saying what was done; None when no
    dropout of the user's dropped anything."""
    dropouts = [r for r in records if r.func == "dropout" and r.details.get("training") and r.parents
                and not torch.equal(records[r.parents[0]].tensor, r.tensor)]
    if not dropouts:
        return None
    if "attention" not in trace:
        return None, _unapplied(dropouts[0], records)
    attention = trace["attention"]
    for record in dropouts:
        before = records[record.parents[0]]
        match = next(iter(compare(before, attention)), None)
        if match is None or not match.equal:  # merged too: heads folded into the batch, or a module of one head
            continue  # whose [n_batch, n_Q, n_K] is the attention's [n_batch, 1, n_Q, n_K]
        shape = tuple(attention.shape)
        after = match.layout.undo(record.tensor, shape).to(attention.dtype)
        kept = match.layout.undo(before.tensor, shape).to(attention.dtype)
        p = float(record.details.get("p", 0.0))
        multiplier = torch.where(kept != 0, after / kept.where(kept != 0, torch.ones_like(kept)),
                                 torch.where(after == 0, 0.0, 1 / (1 - p) if p < 1 else 0.0))
        zeroed = float((multiplier == 0).double().mean())
        note = (f"dropout in training mode: line {record.line} zeroed {zeroed:.1%} of the attention (p = {p:g}); "
                "the reference applies that same mask, read from your tensors, after its attention, so the steps "
                "after it are still compared")
        return _after_attention(trace, attention * multiplier, reference), note
    return None, _unapplied(dropouts[0], records)


def _unapplied(record: Record, records: list[Record]) -> str:
    before = records[record.parents[0]]
    zeroed = float(((record.tensor == 0) & (before.tensor != 0)).double().mean())
    return (f"dropout in training mode: line {record.line} zeroed {zeroed:.1%} of {before.label} at random (p = "
            f"{record.details.get('p', 0.0):g}); its input matches no reference step to apply the same mask to, so "
            "the steps before it are compared, and those after it differ by that")


def _after_attention(trace: Trace, dropped: torch.Tensor, reference: Any) -> Trace:
    """The trace with every step after `attention` computed again from `dropped`."""
    from attnscope.attention.stages import heads_last

    out = Trace(notes=list(trace.notes))
    after = False
    values = next(name for name in ("V_rep", "V_cat", "V_split", "V") if name in trace)
    col = trace.step("attention").dims[-1] == "n_Q"  # the column form's [.., n_K, n_Q] (usertrace/columns.py)
    for step in trace.steps:
        if not after:
            out.add_step(step)
            after = step.name == "attention"
            continue
        if step.name in ("x_raw", "out") and col:
            tensor = trace[values].to(dropped.dtype) @ dropped  # [.., d, n_K] @ [.., n_K, n_Q] -> [.., d, n_Q]
        elif step.name in ("x_raw", "out"):
            tensor = dropped @ trace[values].to(dropped.dtype)  # [.., n_Q, n_K] @ [.., n_K, d] -> [.., n_Q, d]
        elif step.name == "x_rsh2" and col:
            tensor = out["x_raw"].reshape(step.shape)  # [n_batch, n_head, d_head, n_Q] -> [n_batch, d_feat, n_Q]
        elif step.name == "x" and col:
            with torch.no_grad():  # W_o on the rows, [n_batch, n_Q, d_feat], then back to columns
                tensor = reference.W_o(out["x_rsh2"].transpose(-2, -1)).transpose(-2, -1)
        elif step.name == "x_rsh1":
            tensor = heads_last(out["x_raw"])  # [n_batch, n_Q, n_head, d_head]
        elif step.name == "x_rsh2":
            tensor = out["x_rsh1"].reshape(step.shape)  # [n_batch, n_Q, n_head·d_head]
        elif step.name == "x":
            with torch.no_grad():
                tensor = reference.W_o(out["x_rsh2"])  # [n_batch, n_Q, d_feat]
        else:
            tensor = step.tensor
        out.add(step.name, tensor, step.dims, f"{step.op}, with your dropout's mask", step.flops, step.allocates)
    return out
