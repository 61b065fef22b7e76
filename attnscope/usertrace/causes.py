"""More causes of a divergence (diagnose.py holds the first ones), each tested on the numbers:

- a mask the user's code applies by itself that the reference was not told of (a `tril` buffer, `is_causal=True`,
  a sliding window): the user's tensor is the reference's under that mask, so the option that describes it is
  named (`--causal`, `--causal lower-right`, `--window W`);
- dropout inside a fused kernel (`F.scaled_dot_product_attention(dropout_p=...)` in training): random, and its
  mask cannot be read back;
- key/value heads repeated in the wrong order for grouped-query attention (`repeat` tiles them, where
  transformers' `repeat_kv` and `repeat_interleave` keep each head's group together).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace.align import ancestors
from attnscope.usertrace.diagnosis import Context, Diagnosis, close, in_reference_layout, label_of

if TYPE_CHECKING:
    from attnscope.spec import WindowSide
    from attnscope.usertrace.align import Match
    from attnscope.usertrace.record import Record


def own_mask(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    from attnscope import masks
    from attnscope.spec import AttentionSpec

    if near is None or step not in ("masked_scores", "attention") or "scores" not in ctx.reference:
        return None
    # the scores the softmax reads: masked, else with a bias or the code's own term added (ownterm.py), else plain
    base = ctx.reference[next(s for s in ("masked_scores", "biased_scores", "scores") if s in ctx.reference)].double()
    user = in_reference_layout(near, step, ctx)
    n_Q, n_K = base.shape[-2], base.shape[-1]
    rules: list[tuple[str | None, int | None, WindowSide]] = [
        (align, window, "left") for align in ("upper-left", "lower-right") for window in (None, *range(1, n_K + 1))]
    rules += [(None, window, "both") for window in range(2, 2 * n_K, 2)]  # a bidirectional local window
    for align, window, side in rules:
        allowed, _ = masks.structural(AttentionSpec(causal=align, window=window, window_side=side), n_Q, n_K)
        assert allowed is not None
        masked = base.masked_fill(~allowed, float("-inf"))
        if bool(torch.equal(torch.isneginf(masked), torch.isneginf(base))):
            continue  # the reference masks these already
        expected = masked if step == "masked_scores" else _softmax(masked)
        if not close(user, expected):
            continue
        said = (f"a window on both sides, |i − j| ≤ {(window or 0) // 2}" if side == "both" else
                f"a sliding window of {window} ({align})" if window else f"a causal mask ({align})")
        if ctx.comparing:
            return Diagnosis(f"B masks where A does not: {label_of(near.record)} is A's {step} under {said}; B's "
                             "code masks by itself, or B's run was given a mask that A's was not", near.record)
        flags = f"--window {window} --window-side both" if side == "both" else (
            "--causal" if align == "upper-left" else "--causal lower-right") + (f" --window {window}" if window else "")
        return Diagnosis(f"your code masks by itself: {label_of(near.record)} is the reference's {step} under "
                         f"{said}, which the reference was not told of; describe it with {flags} (it "
                         "describes the reference whether or not your forward takes a mask)", near.record)
    return None if ctx.comparing else _own_pattern(step, near, user, base)


def _own_pattern(step: str, near: Match, user: torch.Tensor, base: torch.Tensor) -> Diagnosis | None:
    """A pattern of the code's own that no rule says (a local band with global tokens, blocks), the same for every
    sequence and head: the user's tensor is the reference's scores masked where it holds -inf (or its attention
    where it holds 0), and only --mask FILE describes it."""
    n_Q, n_K = base.shape[-2:]
    masked = torch.isneginf(user) if step == "masked_scores" or bool(torch.isneginf(user).any()) else user == 0
    cells = masked.reshape(-1, n_Q, n_K)
    if not bool((cells == cells[:1]).all()) or bool(cells[0].all(-1).any()) or not bool(cells[0].any()):
        return None
    keep = ~cells[0]
    expected = base.masked_fill(~keep, float("-inf"))
    if bool(torch.equal(torch.isneginf(expected), torch.isneginf(base))):
        return None  # the reference masks these already
    if not (close(user, expected) or close(user, _softmax(expected))):
        return None
    return Diagnosis(f"your code masks by itself with a pattern of its own: {label_of(near.record)} is the "
                     f"reference's {step} with {int((~keep).sum())} of the {n_Q * n_K} cells of [n_Q, n_K] masked, "
                     "the same for every sequence and head, which no causal or window rule is and the reference was "
                     "not told of; describe it with --mask FILE, [n_Q, n_K], True = may attend (it describes the "
                     "reference whether or not your forward takes a mask)", near.record)


def kernel_dropout(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    if near is None:
        return None
    for index in sorted(ancestors(near.record, ctx.records) | {near.record.index}, reverse=True):
        record = ctx.records[index]
        asked = record.details.get("kernel") or {}
        p = asked.get("dropout_p") or 0.0
        if isinstance(p, (int, float)) and p > 0 and asked.get("training", True):
            rerun = _rerun_without_dropout(step, ctx, near, record, asked)
            mask = ("" if rerun is not None else
                    ": its mask cannot be read back to apply to the reference")
            found = Diagnosis(f"{label_of(near.record)} comes through {record.call} at line {record.line}, which drops "
                              f"attention weights at random inside its kernel (dropout_p={p:g}){mask}; "
                              f"{_kernel_dropout_fix(record, asked, ctx.train)}", near.record)
            if rerun is not None and not ctx.train:  # with --train the dropout is asked for: no mistake of the code
                found.experiment, found.evidence = "dropout.left_on", rerun
            return found
    return None


def _rerun_without_dropout(step: str, ctx: Context, near: Match, record: Record, asked: dict[str, Any]) -> str | None:
    """The experiment for a kernel's dropout, whose mask cannot be read back to apply to the reference: the code's
    own call run again with its dropout off (kernels._undropped) gives back the reference's `step` (the call's
    output is the diverging tensor). The evidence line, or None where it does not."""
    undropped = asked.get("undropped")
    if record.index != near.record.index or not isinstance(undropped, torch.Tensor):
        return None
    shape = tuple(ctx.reference[step].shape)
    try:
        user = near.layout.undo(undropped, shape).double()
    except RuntimeError:
        return None
    if not close(user, ctx.reference[step].double()):
        return None
    off = ", ".join(f"{k}={v}" for k, v in (asked.get("off") or {}).items())
    return (f"by experiment: your {record.call} at line {record.line} run again with {off} gives back the reference's "
            f"{step} to tolerance")


def _kernel_dropout_fix(record: Record, asked: dict[str, Any], train: bool) -> str:
    """What to change so that a kernel's dropout is off where the reference has none: --train, when given; else the
    call's own argument that left it on (F.multi_head_attention_forward's `training`, True unless passed: torch hands
    every argument on, so whether the code passed it cannot be told; SDPA's dropout_p, which has no training flag)."""
    if train:
        return "drop --train to compare the computation (trace runs the module in eval() mode without it)"
    if "training" in asked:
        return (f"its training argument is True ({record.call}'s default where the call leaves it out), so it drops "
                "even in eval() mode: pass training=self.training, as nn.MultiheadAttention does")
    return ("it has no training flag, so it drops in eval() mode too: pass dropout_p=self.dropout if self.training "
            "else 0.0 (as nanoGPT does)")


def repeat_order(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    """Told by the numbers twice: the user's tensor is the reference's key/value heads tiled, or (when what it
    repeats differs from the reference too, RoPE applied without --rope say) the user's own key/value tensor it was
    computed from, tiled, where interleaving it would not give it."""
    if near is None or step not in ("K_rep", "V_rep"):
        return None
    source = next((s for s in (f"{step[0]}_rot", f"{step[0]}_cat", f"{step[0]}_split", step[0])
                   if s in ctx.reference and ctx.reference[s].dim() == ctx.reference[step].dim()), None)
    if source is None:
        return None
    kv = ctx.reference[source]
    n_group = ctx.reference[step].shape[-3] // kv.shape[-3]
    user = in_reference_layout(near, step, ctx)
    besides = ""
    if not close(user, _tiled(kv, n_group).double()):
        own = _repeated(user, near, ctx, tuple(kv.shape), n_group)
        if own is None:
            return None
        besides = (f"; besides, what it repeats, {label_of(own)}, is not the reference's {source}"
                   f"{_why_not(own, source, ctx)}")
    return Diagnosis(f"key/value heads repeated in the wrong order: {label_of(near.record)} tiles the {kv.shape[-3]} "
                     f"key/value heads (0, 1, ..., 0, 1, ...), as .repeat(1, {n_group}, 1, 1) does, where query head h "
                     f"reads key/value head h // {n_group} (0, 0, ..., 1, 1, ...): "
                     f"repeat_interleave({n_group}, dim=1), as transformers' repeat_kv{besides}", near.record)


def _tiled(kv: torch.Tensor, n_group: int) -> torch.Tensor:
    return kv.repeat(*([1] * (kv.dim() - 3)), n_group, 1, 1)


def _repeated(user: torch.Tensor, near: Match, ctx: Context, shape: tuple[int, ...], n_group: int) -> Record | None:
    """The user's key/value tensor (in the reference's shape) that `user` (`near`'s, in the reference's layout)
    tiles, where interleaving its heads would not give it: the nearest such ancestor."""
    for index in sorted(ancestors(near.record, ctx.records), reverse=True):
        record = ctx.records[index]
        if tuple(record.tensor.shape) != shape:
            continue
        kv = record.tensor.double()
        if close(user, _tiled(kv, n_group)) and not close(user, kv.repeat_interleave(n_group, dim=-3)):
            return record
    return None


def _why_not(record: Record, source: str, ctx: Context) -> str:
    """`record` against the reference's `source`: RoPE the reference was not told of, or how far apart."""
    from attnscope.usertrace.rotary import fit_base

    expected = ctx.reference[source].double()
    user = record.tensor.double()
    untold = ctx.spec is None or ctx.spec.rope_base is None
    if untold and "_cat" not in source and user.dim() >= 2:
        positions = torch.arange(user.shape[-2])
        for pairing in ("half", "interleaved"):
            base = fit_base(expected, user, positions, pairing)  # any base, read from the turns, then checked
            if base is not None:
                return (f": it is {source} rotated by RoPE (base {base:g}), which the reference was not told of; "
                        f"pass --rope" + (f" --rope-base {base:g}" if base != 10000.0 else ""))
    return f" (max |diff| {float((user - expected).abs().max()):.3g})"


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """softmax over the keys, a query that may see no key getting zeros (PyTorch's `_safe_softmax`)."""
    out = torch.softmax(scores, dim=-1)
    return out.masked_fill(torch.isneginf(scores).all(-1, keepdim=True), 0.0)
