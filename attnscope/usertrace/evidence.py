"""What a rerun that the code's tensors agree with is evidence of (rerun.reproduces asks it last).

`align.difference` meets a NaN of the run's with a NaN (or ±inf) of the code's, and an inf with an equal inf: the
code's non-finite cells must be where the run's are, its finite cells equal to the run's. That is not yet evidence
of a mistake: any mistake whose run is NaN where the code's output is NaN agrees there, whatever made the code's NaN
(HF Pix2Struct's 0/1 keep mask handed as 0 / -inf made correct code NaN, and `mask.after_softmax`'s run, NaN too,
was named by experiment). A run is evidence where

- its non-finite cells are explained: where the run's output holds NaN or inf that the reference's does not, the
  step where the run first holds such a cell (the origin: +inf scores of q @ kᵀ in float16, -inf weights of a mask
  added after the softmax) and the last step where they still stand beside finite cells (past it, NaN everywhere
  tells nothing) are held by the code, each with finite cells: NaN and inf in the same places and the finite cells
  equal to the run's, so the code's non-finite values start where the mistake's do and spread as they do;
- and the mistake shows in the code's numbers: a step the code holds has finite cells where the run differs from the
  reference beyond the tolerance it was compared with, or rows the run masks whole where the reference's keep a key
  (the code's masked whole there too), or the origin above is held.

A query row the run masks whole (`skips`) is left out of both. A -inf in the scores before the softmax is a masked
key, not a value gone wrong: there only NaN and +inf count as not finite.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnscope.usertrace.align import PRE_SOFTMAX

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnscope.usertrace.record import Record


def gone_wrong(name: str, run: torch.Tensor, ref: torch.Tensor | None, skip: torch.Tensor | None) -> torch.Tensor:
    """The cells where the run's `name` is not finite and the reference's is (all of the run's non-finite cells
    where the two differ in shape), less the `skip`ped rows: NaN or ±inf, a -inf before the softmax excepted."""
    bad = torch.isnan(run) | torch.isposinf(run) if name in PRE_SOFTMAX else ~torch.isfinite(run)
    if ref is not None and tuple(ref.shape) == tuple(run.shape):
        bad = bad & torch.isfinite(ref)
    return bad & ~skip if skip is not None else bad


def finite_change(run: torch.Tensor, ref: torch.Tensor | None, skip: torch.Tensor | None, tol: float) -> bool:
    """Whether the run holds a finite cell (not `skip`ped) that differs from the reference's beyond `tol`, or where
    the reference's is not finite (every finite cell where the two differ in shape)."""
    run = run.double()
    moved = torch.isfinite(run)
    if ref is not None and tuple(ref.shape) == tuple(run.shape):
        ref = ref.double()
        moved = moved & (~torch.isfinite(ref) | ((run - ref.where(torch.isfinite(ref), run)).abs() > tol))
    if skip is not None:
        moved = moved & ~skip
    return bool(moved.any())


def evidenced(order: list[str], last: str, ref: dict[str, torch.Tensor], steps: dict[str, torch.Tensor],
              skips: dict[str, torch.Tensor], held: dict[str, Record],
              tol_of: Callable[[torch.Tensor, Record], float]) -> bool:
    """Whether a run the code agrees with is evidence of its mistake (module doc). `held`: each step of the run the
    code holds (its output `last` among them), and the record that holds it; `tol_of(ref_step, record)`: the tolerance
    the step was compared with."""
    def wrong(name: str) -> torch.Tensor:
        return gone_wrong(name, steps[name], ref.get(name), skips.get(name))

    def finite(name: str) -> bool:
        kept = torch.isfinite(steps[name])
        return bool((kept & ~skips[name] if name in skips else kept).any())

    origin_held = False
    if bool(wrong(last).any()):  # the output's NaN or inf must start where the code's own do, and spread as they do
        spread = [n for n in dict.fromkeys([*order, last]) if n in steps and bool(wrong(n).any())]
        seen = [n for n in spread if finite(n)]  # steps where the non-finite cells still stand beside finite ones
        if not seen or seen[0] != spread[0] or spread[0] not in held or seen[-1] not in held:
            return False
        origin_held = True
    return origin_held or any(
        finite_change(steps[n], ref.get(n), skips.get(n), tol_of(ref.get(n, steps[n]), record))
        or masked_anew(n, ref.get(n), skips.get(n)) for n, record in held.items())


def masked_anew(name: str, ref: torch.Tensor | None, skip: torch.Tensor | None) -> bool:
    """Whether the run masks a query's row whole (`skip`) at `name`, the masked scores or the weights, where the
    reference's row keeps a key: the code that holds the step masks that row whole too (rerun's held checks it), a
    change in its numbers (a padding mask laid on the queries)."""
    if skip is None or ref is None or name not in ("masked_scores", "attention") or skip.shape != ref.shape:
        return False
    whole = torch.isneginf(ref).all(-1) if name == "masked_scores" else (ref == 0).all(-1)
    return bool((skip.all(-1) & ~whole).any())
