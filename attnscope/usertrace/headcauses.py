"""Causes around the heads and the scores' numbers, each told by the numbers (diagnose.py asks them):

- heads split by `view(n_batch, n_head, n_Q, d_head)` without the transpose: a user tensor is the reference's
  `*_feat` viewed so, which mixes positions into heads;
- heads merged with the wrong permute: `x_rsh2` is `x_raw` permuted some other way than (0, 2, 1, 3), then viewed
  as `[n_batch, n_Q, d_feat]` (the view with no permute at all is diagnose.py's `_merged_before_permute`);
- qk-norm the reference does not apply (timm's `qk_norm=True`, OLMo2, Qwen3, Gemma 3): the user's scores are the
  reference's computed from `Q_split` and `K_split` normalized over `d_head` (LayerNorm or RMSNorm, with
  per-channel weights fitted from the user's own normalized tensors);
- float16 that overflows: an op in float16 made `inf` (largest float16: 65504) where the reference's numbers
  are finite.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from attnscope.usertrace.align import ancestors
from attnscope.usertrace.diagnosis import Context, Diagnosis, close, equal_record, in_reference_layout, label_of

if TYPE_CHECKING:
    from attnscope.usertrace.align import Match
    from attnscope.usertrace.record import Record

HEAD_SPLITS = {"Q": "n_Q", "K": "n_K", "V": "n_K"}


def split_without_transpose(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    """A whole cause: some user tensor is X_feat viewed straight as [n_batch, n_head, n, d_head]."""
    for role, n in HEAD_SPLITS.items():
        feat, split = f"{role}_feat", f"{role}_split"
        feat = f"{role}_pooled" if f"{role}_pooled" in ctx.reference else feat  # pooled after the projection
        if feat not in ctx.reference or split not in ctx.reference or ctx.reference[split].dim() != 4:
            continue
        right = ctx.reference[split].double()
        # [n_batch, n, d_feat] read as [n_batch, n_head, n, d_head]: no transpose
        wrong = ctx.reference[feat].double().reshape(right.shape)
        if close(wrong, right):
            continue
        record = equal_record(ctx.records, wrong)
        if record is not None and right.shape[1] == right.shape[2] and _swapped_to(ctx.records, record, right):
            continue  # as many tokens as heads: [n_batch, n, n_head, d_head] before the code's own transpose
        if record is not None:
            return Diagnosis(f"heads split without the transpose: {label_of(record)} is {feat} [n_batch, {n}, "
                             f"d_feat] viewed straight as [n_batch, n_head, {n}, d_head], so each head holds a "
                             f"run of whole feature rows of several positions, not one slice of every position; "
                             f"view as [n_batch, {n}, n_head, d_head], then .transpose(1, 2)", record)
    return None


def _swapped_to(records: list[Record], record: Record, right: torch.Tensor) -> bool:
    """Whether the code swaps axes of `record` (a transpose, a permute: joint.SWAPS) into `right`, the reference's
    split: with as many tokens as heads, `[n_batch, n, n_head, d_head]` has the shape of `[n_batch, n_head, n,
    d_head]`, and the view before the code's own `.transpose(1, 2)` is the right one, not a split without it."""
    from attnscope.usertrace.joint import SWAPS

    return any(r.func.split(".")[-1] in SWAPS and record.index in r.parents and close(r.tensor, right)
               for r in records[record.index + 1:])


def merged_with_wrong_permute(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    """A whole cause, at the merge and after: x_raw permuted another way, then viewed as [n_batch, n_Q, d_feat]."""
    if step not in ("x_rsh1", "x_rsh2", "x") or "x_raw" not in ctx.reference or ctx.reference["x_raw"].dim() != 4:
        return None
    x_raw = ctx.reference["x_raw"].double()  # [n_batch, n_head, n_Q, d_head]
    n_batch, n_head, n_Q, d_head = x_raw.shape
    shape = (n_batch, n_Q, n_head * d_head)
    for order in itertools.permutations(range(4)):
        if order in ((0, 2, 1, 3), (0, 1, 2, 3)) or order[0] != 0:
            continue
        # [n_batch, n_head, n_Q, d_head] -> [n_batch, n_Q, n_head·d_head]
        record = equal_record(ctx.records, x_raw.permute(order).reshape(shape))
        if record is not None:
            dims = ("n_batch", "n_head", "n_Q", "d_head")
            became = ", ".join(dims[a] for a in order)
            return Diagnosis(f"heads merged with the wrong permute: {label_of(record)} is x_raw [n_batch, n_head, "
                             f"n_Q, d_head] permuted {order} to [{became}], then viewed as [n_batch, n_Q, d_feat], "
                             "so each row mixes heads' features in the wrong order; .permute(0, 2, 1, 3) (or "
                             ".transpose(1, 2)) gives [n_batch, n_Q, n_head, d_head], then .reshape", record)
    return None


def qk_norm(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    """At the scores and after: the user's tensor is the reference's with Q_split and/or K_split normalized."""
    if near is None or step not in ("scores", "masked_scores", "attention"):
        return None
    if not {"Q_split", "K_split", "scores"} <= set(ctx.reference):
        return None
    q, k = ctx.reference["Q_split"].double(), ctx.reference["K_split"].double()
    if q.shape[-1] != k.shape[-1] or q.dim() != k.dim() or q.shape[-3] % k.shape[-3]:
        return None
    if q.shape[-3] != k.shape[-3]:  # grouped-query: each key/value head read by n_group query heads, as K_rep
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    plain = q @ k.transpose(-1, -2)  # [.., n_Q, d] @ [.., d, n_K] -> [.., n_Q, n_K]
    scores = ctx.reference["scores"].double()
    if plain.shape != scores.shape:  # a decode step: the scores read the cache's keys too
        return None
    usable = plain.abs() > 1e-6
    if not bool(usable.any()):
        return None
    scale = float((scores[usable] / plain[usable]).median())
    user = in_reference_layout(near, step, ctx)
    normed_q, normed_k = _normalized(q, ctx.records), _normalized(k, ctx.records)
    for (q_rec, q_kind), (k_rec, k_kind) in itertools.product([*normed_q, (None, "")], [*normed_k, (None, "")]):
        if q_rec is None and k_rec is None:
            continue
        qn = q_rec.tensor.double() if q_rec is not None else q
        kn = k_rec.tensor.double() if k_rec is not None else k
        if qn.shape[-3] != kn.shape[-3]:
            continue
        expected = scale * (qn @ kn.transpose(-1, -2))  # [.., n_Q, n_K]
        if step != "scores":
            allowed = ~torch.isneginf(ctx.reference["masked_scores"]) if "masked_scores" in ctx.reference else None
            if allowed is not None:
                expected = expected.masked_fill(~allowed, float("-inf"))
            if step == "attention":
                expected = torch.softmax(expected, dim=-1).nan_to_num(0.0)
        if not close(torch.where(torch.isneginf(expected), 0.0, user.nan_to_num(0.0).clamp_min(-1e30)),
                     torch.where(torch.isneginf(expected), 0.0, expected)):
            continue
        where = "; ".join(f"{label_of(r)} is {name} normalized over d_head ({kind})"
                          for r, kind, name in ((q_rec, q_kind, "Q_split"), (k_rec, k_kind, "K_split")) if r)
        if q_rec is None or k_rec is None:
            which = "the keys" if q_rec is None else "the queries"
            return Diagnosis(f"qk-norm on one side only: {where}, but {which} are not normalized; qk-norm normalizes "
                             "both q and k per head before the scores", near.record)
        if q_kind == k_kind:  # LayerNorm (timm's default norm_layer) or RMSNorm
            told = (f"describe it with --qk-norm head (the reference then normalizes with your norms' weights"
                    f"{' and biases' if 'LayerNorm' in (q_kind, k_kind) else ''})"
                    if ctx.spec is None or ctx.spec.qk_norm is None else "")
        else:
            told = ("q and k are normalized by different kinds of norm, where the reference's qk-norm (--qk-norm) "
                    "normalizes both with one, a LayerNorm or an RMSNorm")
        return Diagnosis(f"your code applies qk-norm: {where}, before the scores (timm's qk_norm=True, OLMo2, Qwen3), "
                         f"which the reference was not told of; {told}" if told else
                         f"your code applies qk-norm: {where}, before the scores", near.record)
    return None


def _normalized(x: torch.Tensor, records: list[Record]) -> list[tuple[Record, str]]:
    """User tensors of x's shape that are x normalized over its last axis, LayerNorm's way or RMSNorm's, then
    scaled (and shifted) per channel."""
    found = []
    centred = x - x.mean(-1, keepdim=True)
    forms = (("LayerNorm", centred / (centred.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt(), True),
             ("RMSNorm", x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt(), False))
    for record in records:
        if tuple(record.tensor.shape) != tuple(x.shape) or not record.tensor.is_floating_point():
            continue
        user = record.tensor.double()
        if close(user, x):
            continue
        for kind, z, shift in forms:
            if _affine(z, user, shift):
                found.append((record, kind))
                break
    return found


def _affine(z: torch.Tensor, user: torch.Tensor, shift: bool) -> bool:
    """user = z · w + b per channel (b = 0 without shift), for some w and b fitted by least squares."""
    zs, us = z.reshape(-1, z.shape[-1]), user.reshape(-1, z.shape[-1])  # [n_rows, n_channel] each
    if shift:
        zm, um = zs.mean(0), us.mean(0)
        w = ((zs - zm) * (us - um)).sum(0) / ((zs - zm).pow(2).sum(0) + 1e-12)
        b = um - w * zm
    else:
        w = (zs * us).sum(0) / (zs.pow(2).sum(0) + 1e-12)
        b = torch.zeros_like(w)
    fitted = zs * w + b
    return float((fitted - us).abs().max()) <= 1e-3 * max(float(us.abs().max()), 1.0)


def float16_overflow(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    """A user tensor with inf/NaN where the reference is finite, made by an op in float16 from finite inputs."""
    if near is None:
        return None
    reference = ctx.reference[step]
    if int((~torch.isfinite(near.record.tensor)).sum()) <= int((~torch.isfinite(reference)).sum()):
        return None
    for index in sorted(ancestors(near.record, ctx.records) | {near.record.index}):
        record = ctx.records[index]
        if record.tensor.dtype not in (torch.float16, torch.bfloat16) or bool(torch.isfinite(record.tensor).all()):
            continue
        if not all(bool(torch.isfinite(ctx.records[p].tensor).all()) for p in record.parents):
            continue
        largest = torch.finfo(record.tensor.dtype).max
        overflowed = int(torch.isinf(record.tensor).sum())
        name = str(record.tensor.dtype).removeprefix("torch.")
        return Diagnosis(f"{name} overflows: {label_of(record)} ({record.call}) is computed in {name}, whose largest "
                         f"number is {largest:.6g}, and {overflowed} of its values passed it and became inf (the "
                         f"reference's {step} reaches {float(reference.double().abs().max()):.3g} in float32); compute "
                         "it in float32, or scale q by 1/√d_head before the matmul", near.record)
    return None
