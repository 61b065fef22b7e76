"""What the kinds of mistakes share: the user's own tensors read back in the reference's frame, the blocks a
kernel computed, whether the run is masked, a size's root in words."""

from __future__ import annotations

import math

import torch

from attnscope.usertrace.rerun import Base


def has_mask(b: Base) -> bool:
    return b.allowed is not None and bool((~b.allowed).any()) and "masked_scores" in b.ref


def blocks_computed(b: Base) -> torch.Tensor | None:
    """In code that calls no softmax (online softmax over blocks), the cells of the scores its blocks cover, each
    block's exp(scores − max) placed where its scores stand in the reference's; None where it covers them all, or
    a block is not placed."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.flow import EXPONENTS
    from attnscope.usertrace.record import SOFTMAXES

    records = b.ctx.records
    if b.col or "scores" not in b.ref or any(r.func in SOFTMAXES for r in records):
        return None
    scores = b.ref["scores"]
    covered = torch.zeros_like(scores, dtype=torch.bool)
    for record in records:
        if record.func not in EXPONENTS or record.tensor.dim() != scores.dim():
            continue
        above = sorted(ancestors(record, records), reverse=True)
        at = next((found for i in above if records[i].tensor.shape == record.tensor.shape
                   and records[i].tensor.is_floating_point()
                   and (found := block_at(records[i].tensor.double(), scores)) is not None), None)
        if at is None:
            continue  # a renormalizing factor's exp (exp(m - m_new)), no block of weights
        a, c = record.tensor.shape[-2:]
        covered[..., at[0]:at[0] + a, at[1]:at[1] + c] = True
    return None if bool(covered.all()) or not bool(covered.any()) else covered


def block_at(block: torch.Tensor, scores: torch.Tensor) -> tuple[int, int] | None:
    """Where a block of scores `[.., a, c]` stands in the reference's `[.., n_Q, n_K]`: the first offset whose values
    it holds to tolerance; None where none, or the leading axes differ."""
    from attnscope.usertrace.align import tolerance

    if block.shape[:-2] != scores.shape[:-2] or block.shape[-2] > scores.shape[-2] \
            or block.shape[-1] > scores.shape[-1] or scores.shape[-2] * scores.shape[-1] > 1 << 16:
        return None
    tol = tolerance(scores, torch.float32)
    a, c = block.shape[-2:]
    for i in range(scores.shape[-2] - a + 1):
        for j in range(scores.shape[-1] - c + 1):
            if float((scores[..., i:i + a, j:j + c] - block).abs().max()) <= tol:
                return i, j
    return None


def user_out(b: Base, name: str) -> torch.Tensor:
    """A reference step in the user's layout (the column form's own)."""
    return back_row(b, b.ref[name])


def back_row(b: Base, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.transpose(-1, -2) if b.col and tensor.dim() >= 2 else tensor


def say_root(n: int) -> str:
    root = math.isqrt(n)
    return f"{root}" if root * root == n else f"{math.sqrt(n):.3g}"
