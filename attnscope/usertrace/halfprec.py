"""Attention the code computes in float16 or bfloat16 by design: a convention, not a mistake, where it stays finite.

Large scores in float16 lose digits (q · kᵀ near 16 000 is held to the nearest 16), and the softmax turns a score's
rounding into a weight's: the code's weights part from the float64 reference's though nothing is wrong. The
reference is then run again in the code's own dtypes, step by step as the code's records show them (q @ kᵀ, the
scaled scores, the softmax and its weighted sum of the values; rerun.replay's `precision`), from the code's own heads
where it holds them to its dtype's tolerance (align.held_tolerance: projections run in float16 too). Where that run
gives the code's tensors back to float16's tolerance (rerun.reproduces, tol "float16") and no score overflowed, the
difference is float16's rounding: said as a note, no divergence. A run with an inf is float16.overflow's to name
(runtrials.trials_float16), and a mistake of the catalog is named only where it is not this rerun that holds the code.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from attnscope.usertrace.align import ancestors, best_equal
from attnscope.usertrace.record import SOFTMAXES

if TYPE_CHECKING:
    from attnscope.usertrace.diagnosis import Context
    from attnscope.usertrace.rerun import Base

HALVES = (torch.float16, torch.bfloat16)
PRODUCTS = ("matmul", "__matmul__", "bmm", "einsum", "baddbmm", "mm")


def precision(b: Base) -> dict[str, torch.dtype] | None:
    """The dtype the code computes q @ kᵀ ("product"), its scaled scores ("scores") and its softmax ("attention")
    in, read off the records of the softmax and what it is made from; None where none of them is float16 or
    bfloat16, or the code holds no softmax of the scores' size."""
    records, size = b.ctx.records, b.ref["scores"].numel()
    softmax = next((r for r in records if r.func.split(".")[-1] in SOFTMAXES and r.tensor.numel() == size), None)
    if softmax is None or not softmax.parents:
        return None
    above = [records[i] for i in sorted(ancestors(softmax, records))
             if records[i].tensor.is_floating_point() and records[i].tensor.numel() == size]
    product = next((r for r in above if r.func.split(".")[-1] in PRODUCTS), above[0] if above else None)
    found = {"product": product.tensor.dtype if product is not None else torch.float64,
             "scores": records[softmax.parents[0]].tensor.dtype, "attention": softmax.tensor.dtype}
    return found if any(dtype in HALVES for dtype in found.values()) else None


def own_heads(b: Base) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The code's q, new keys and values where it holds them to its dtype's tolerance (float64, the row form), the
    reference's where it does not: a float16 projection's rounding carried into the rerun as the code carries it."""
    heads = []
    for ref in (b.q, b.k_new, b.v_new):
        match = best_equal(b.ctx.records, ref, None)
        heads.append(ref if match is None else match.layout.undo(match.record.tensor, tuple(ref.shape)).double())
    return heads[0], heads[1], heads[2]


def in_code_dtype(b: Base | None) -> Base | None:
    """`b` with the code's own heads and dtypes (`Base.precision`) where the code computes its attention in float16
    or bfloat16: every rerun made from it, the catalog's included, is then the code's computation in its dtype, and a
    mistake is named only where its run gives the code's tensors back past that dtype's rounding. `b` itself where
    the code's attention is float32 or float64."""
    from attnscope.usertrace.rerun import replay

    dtypes = precision(b) if b is not None and not b.col else None
    if b is None or dtypes is None:
        return b
    q, k, v = own_heads(b)
    made = replace(b, q=q, k_new=k, v_new=v, precision=dtypes, runs={}, sums={})
    # a run in the code's dtypes that overflows reproduces any mistake's infs alike: the float64 base then, and
    # float16.overflow's own run (runtrials.trials_float16) the one in float16
    return b if overflows(b, replay(made)) else made


def overflows(b: Base, steps: dict[str, torch.Tensor]) -> bool:
    """Whether the run's scores hold a NaN or an inf where the reference's are finite."""
    return bool((~torch.isfinite(steps["scores"]) & torch.isfinite(b.ref["scores"])).any())


def rounding_only(ctx: Context, step: str) -> str | None:
    """The note that the code's difference from the reference at `step` is its own dtype's rounding (module doc), or
    None where the rerun in its dtypes does not give its tensors back (in_code_dtype: a run that overflows is
    float16.overflow's)."""
    from attnscope.tensors.threads import one_thread
    from attnscope.usertrace.rerun import build, record_holding, replay, reproduces

    if not any(r.tensor.dtype in HALVES for r in ctx.records):  # float32 code: no rerun to build
        return None
    with one_thread():
        b = in_code_dtype(build(ctx))
        if b is None or b.precision is None:
            return None
        dtypes, steps = b.precision, replay(b)
        # the code holds the run's tensor where the line-up parted (the scores as the reference scales them, not
        # merely an output that a softmax of large scores makes alike) and its output
        if step not in steps or record_holding(b.ctx.records, steps[step], None, "float16", b.sums) is None:
            return None
        if reproduces(b, step, steps, tol="float16", strict=False, evidence=False) is None:
            return None
    named = sorted({str(d).removeprefix("torch.") for d in dtypes.values() if d in HALVES})
    where = ", ".join(n for n, d in (("q @ kᵀ", dtypes["product"]), ("the scaled scores", dtypes["scores"]),
                                     ("the softmax", dtypes["attention"])) if d in HALVES)
    return (f"your code computes {where} in {' and '.join(named)}: its tensors differ from the float64 reference "
            f"from {step} on by that dtype's rounding alone (the reference run again in your dtypes gives them back to "
            f"{named[0]}'s tolerance, 2e-3 + 2e-3 · the largest value, coarser than torch.testing.assert_close's "
            f"float16 default, rtol 1e-3, atol 1e-5; no score overflowed): a convention, not a mistake")
