"""The masking step of `sdpa` (attention.py): the spec's own causal, window or chunk mask and the user's mask
under one dtype rule, recorded as `masked_scores`; and the rows that may see no key, whose attention is 0 after
the softmax, as PyTorch's `_safe_softmax` gives. The mask rules themselves are masks.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnscope import masks

if TYPE_CHECKING:
    from torch import Tensor

    from attnscope.spec import AttentionSpec
    from attnscope.trace import Trace


def masked(trace: Trace, logits: Tensor, last: str, mask: Tensor | None, spec: AttentionSpec,
           dims: tuple[str, ...]) -> tuple[Tensor, Tensor | None, str]:
    """Step `masked_scores`: the causal, window or chunk mask, and the user's mask under the one dtype rule (boolean
    masks combine by AND, a float mask is added). Returns the logits, the rows that may see no key (as a
    boolean `[.., n_Q, 1]`, None when nothing was masked) and the name of the last step."""
    n_Q, n_K = logits.shape[-2], logits.shape[-1]
    allowed, described = masks.structural(spec, n_Q, n_K, logits.device)
    parts = [described] if described else []
    additive = None
    if mask is not None:
        user = masks.as_attention_mask(mask.to(logits.device), tuple(logits.shape), logits.dtype)
        if user.dtype == torch.bool:
            allowed = user if allowed is None else allowed & user
            parts.append("mask")
        else:
            additive = user
    if allowed is None and additive is None:
        return logits, None, last
    op = last
    if additive is not None:
        logits, op = logits + additive, f"{last} + mask"
    if allowed is not None:
        hidden = parts[0] if len(parts) == 1 else f"({' & '.join(parts)})"
        logits = logits.masked_fill(~allowed, float("-inf"))
        op = f"({op})" if additive is not None else op
        op = f"{op}.masked_fill(~{hidden}, -inf)"
    trace.add("masked_scores", logits, dims, op, logits.numel(), inputs=(last,))
    if additive is not None:
        seen = additive if allowed is None else torch.where(allowed, additive, float("-inf"))
        return logits, masks.fully_masked_rows(seen), "masked_scores"
    assert allowed is not None
    return logits, masks.fully_masked_rows(allowed), "masked_scores"


def zero_rows(attention: Tensor, blocked: Tensor, trace: Trace, n_Q: int) -> Tensor:
    """A softmax of a row of -inf is NaN; PyTorch's attention gives 0 there (`_safe_softmax`), as attnscope."""
    if attention.device.type != "meta" and not bool(blocked.any()):
        return attention  # no row blocked: nothing to zero (a causal mask blocks none)
    if torch.is_grad_enabled() and attention.requires_grad:
        attention = attention.masked_fill(blocked, 0.0)  # softmax's backward needs its output unchanged
    else:
        attention.masked_fill_(blocked, 0.0)  # in place: no second [.., n_Q, n_K] at the peak
    if attention.device.type != "meta" and n_Q and 0 not in attention.shape[:-2] and bool(blocked.any()):
        rows = blocked if blocked.shape[-1] == 1 else blocked.transpose(-2, -1)  # [.., n_Q, 1]
        rows = rows.expand(*rows.shape[:-2], n_Q, 1)  # a mask shared by every query blocks all n_Q rows
        trace.notes.append(_blocked_note(rows, n_Q))
    return attention


def _blocked_note(blocked: Tensor, n_Q: int) -> str:
    # [.., n_Q, 1] -> [n_rest, n_Q]: the rows any batch element blocks
    rows = sorted({int(i) for i in blocked.reshape(-1, blocked.shape[-2]).any(dim=0).nonzero().flatten()})
    shown = ", ".join(str(i) for i in rows[:12]) + (", ..." if len(rows) > 12 else "")
    return (
        f"{len(rows)} of {n_Q} query rows may attend to no key (n_Q index {shown}): "
        "their attention and output are 0, as in F.scaled_dot_product_attention"
    )
