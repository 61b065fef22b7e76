"""qk-norm read from the code, as RoPE's pairing and base are (runs/trace.py asks, where the first line-up diverges):
the reference run again with a qk-norm over d_head or over the projection, with the module's own norms' weights,
or with a weightless norm read from its rows (rownorms.py), kept where it lines up further."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.lined import LineUp
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Spec


def read(module: Any, shapes: Any, inputs: Inputs, records: list[Record], train: bool, spec: Spec,
                 lined: LineUp) -> tuple[Spec, LineUp] | None:
    """qk-norm read from the code, as RoPE's pairing and base are: where the reference without it diverges at the
    rotated q or k, the scores or after (anywhere, where the module holds a layer that could be a norm), the
    reference is run again with a qk-norm over d_head ("head": timm's qk_norm=True, Qwen3) and over the projection
    ("proj": OLMo 2), with the module's own norms' weights (usertrace/refbuild.py's _qk_norms). A reading is kept
    only where its run lines up further than the first one did (no divergence, or a later one, or at the same step
    one that an experiment of the catalog then reproduces): a norm on one side only is then qknorm.missing by
    experiment, one of another kind stays the first run's diagnosis."""
    from attnscope.usertrace import rownorms
    from attnscope.usertrace.relined import line_up_again

    diverged = lined.divergence
    if diverged is None:
        return None
    names = [row.reference for row in lined.rows]
    first = diverged.reference
    # a norm without weights, read from the code's rows (Llama 4's L2Norm, F.rms_norm, F.normalize)
    rows = rownorms.read(module, records, lined.trace)
    # the scores or after, or the rotated q and k, which a norm before RoPE already changes (Cohere's, Qwen3's), or
    # the keys joined to a decode step's cache or repeated for grouped heads, which a norm changed (nanochat's, a
    # norm after RoPE); any step where the module holds a layer that could be such a norm (a bug before the scores
    # hides it otherwise)
    if "scores" not in names or first not in names or (names.index(first) < names.index("scores")
                                                        and first not in ("Q_rot", "K_rot", "K_cat", "K_rep")
                                                        and not holds_norms(module) and rows is None):
        return None
    tries = [dataclasses.replace(spec, qk_norm=kind, qk_norm_read=True) for kind in ("head", "proj")]
    if rows is not None:  # before the norms' weights where the module holds none, after them where it does
        weightless = dataclasses.replace(spec, qk_norm=rows.over, qk_norm_gain=rows.gain, qk_norm_eps=rows.eps,
                                         qk_norm_read=True)
        gained = _own_gains(module, records, lined)
        tries = tries + [weightless] if holds_norms(module) or gained else [weightless, *tries]
        if gained and rownorms.after_rope(rows.record, records, lined.trace):  # gains on the rotated heads (nGPT's)
            tries.append(dataclasses.replace(spec, qk_norm="head", qk_norm_after=True, qk_norm_read=True))
    if spec.rope_base is not None and holds_norms(module):
        # a norm module with gains (and a bias) on the rotated heads, or on the rotated projection (OLMo 2's norm
        # after RoPE): the same readings after the rotation. A module norm that first makes rows of RMS 1 and then
        # multiplies them by its gain (Meta's RMSNorm, Gemma's 1 + w) has its rows read above too
        tries += [dataclasses.replace(spec, qk_norm=kind, qk_norm_after=True, qk_norm_read=True)
                  for kind in ("head", "proj") if not any(t.qk_norm_after and t.qk_norm == kind for t in tries)]
    kept: tuple[Spec, LineUp] | None = None  # a reading that lines up further, its divergence unnamed
    for asked in tries:
        again = line_up_again(module, shapes, inputs, records, train, asked)
        if again is None:
            continue
        later = again.divergence is None or (again.divergence.reference in names
                                             and names.index(again.divergence.reference) > names.index(first))
        if later and again.divergence is not None and diverged.experiment is not None \
                and again.divergence.experiment is None:
            # the first run's divergence named by experiment: a reading that diverges later, unnamed, lines up
            # further only where it lines up that step (not where it merely loses sight of it: the split heads of a
            # code whose view is the mistake, unseen beside a norm over the projection)
            later = any(row.reference == first and row.status in ("equal", "permuted") for row in again.rows)
        # or any step (the same, an earlier one the first run saw no further than by chance, one only the reading
        # has: its q normed, where the code norms after RoPE) where only the reading lets an experiment of the
        # catalog reproduce the code's tensors, its output included
        explained = again.divergence is not None and again.divergence.experiment is not None \
            and diverged.experiment is None
        if not (later or explained):
            continue
        if again.divergence is None or again.divergence.experiment is not None:
            return asked, _noted(asked, again, rows, records, lined, holds_norms(module))
        # diverging later unnamed: kept unless a later reading (the norm after RoPE) lines up or names the mistake
        kept = kept or (asked, again)
    return None if kept is None else (kept[0], _noted(kept[0], kept[1], rows, records, lined, holds_norms(module)))


def _noted(asked: Spec, again: LineUp, rows: Any, records: list[Record], lined: LineUp, held: bool) -> LineUp:
    """`again` with the note that says which qk-norm reading the reference took (`held`: the module holds norm
    layers, whose weights the reference takes)."""
    from attnscope.usertrace import rownorms

    kind = asked.qk_norm
    if asked.qk_norm_gain is not None and rows is not None:
        flag = f" (--qk-norm {kind} says so)" if rows.kind == "RMS" else ", with that gain"
        after = rownorms.after_rope(rows.record, records, again.trace)
        after = _after_rope(rows.record, lined) if after is None else after
        again.notes.append(f"{rows.words(after)}: read as its own convention, and the reference applies it too{flag}")
    elif asked.qk_norm_after and rows is not None and not held:
        again.notes.append("your code normalizes q and k after RoPE, each rotated head over its d_head, with gains of "
                           "its own (qk-norm on the rotated heads, nGPT's): read as its own convention, and the "
                           "reference applies it too, after its rotation, with your gains")
    elif asked.qk_norm_after:
        over = "each rotated head over its d_head" if kind == "head" else \
            "over the whole projection, every rotated head of a position at once"
        again.notes.append(f"your code normalizes q and k after RoPE, {over} (qk-norm on the rotated heads): read as "
                           "its own convention, and the reference applies it too, after its rotation, with your "
                           "norms' weights")
    else:
        over = "d_head, each head's q and k" if kind == "head" else "the whole projection, q's and k's width"
        again.notes.append(f"your code normalizes q and k before the scores (qk-norm over {over}): read as its own "
                           "convention, and the reference applies it too, with your norms' weights "
                           f"(--qk-norm {kind} says so)")
    return again


def _after_rope(record: Record, lined: LineUp) -> bool | None:
    """Whether the code normalizes after it rotates: the record comes after the one that lined up with the
    reference's rotated queries or keys; None without RoPE."""
    rotated = [row.record.index for row in lined.rows if row.reference in ("Q_rot", "K_rot") and row.record is not None]
    return None if not rotated else record.index > min(rotated)


def _own_gains(module: Any, records: list[Record], lined: LineUp) -> bool:
    """The module multiplies its normalized q and k by parameters of its own (`F.rms_norm(q, (d,)) * self.q_gain`,
    usertrace/baregains.py): its norms hold weights, though it holds no norm layer."""
    from attnscope.usertrace import baregains

    trace = lined.trace
    if trace is None or "Q_split" not in trace or "Q_feat" not in trace:
        return False
    widths = {int(trace["Q_split"].shape[-1]), int(trace["Q_feat"].shape[-1])}
    return len(baregains.read(module, records, widths)) >= 2


def holds_norms(module: Any) -> bool:
    """The module holds a layer with parameters of its own other than a projection or an embedding: a norm,
    perhaps."""
    import torch

    if not isinstance(module, torch.nn.Module):
        return False
    return any(m is not module and not isinstance(m, (torch.nn.Linear, torch.nn.Embedding))
               and next(m.parameters(recurse=False), None) is not None for m in module.modules())
