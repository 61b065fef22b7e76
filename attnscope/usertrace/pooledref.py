"""The reference over queries, keys or values the code pools along the tokens after their projection (pooled.py
reads them; `Spec.pooled` holds the code's pooled tensors): the reference's projections' steps, the pooled tensors as
the code made them, and the attention from there, run with identity projections on them."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from attnscope.trace import Trace
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Projections, Spec


def combined(trace: Trace, projections: Projections, n_head: int, spec: Spec, module: Any, records: list[Record],
             inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
             mask: torch.Tensor | None = None) -> tuple[Trace, Any]:
    """The reference over the code's pooled tensors (`spec.pooled`): its projections' steps (`Q_feat`, `K_feat`,
    `V_feat`: what the code pools), the pooled ones as the code made them (`*_pooled`), and the rest of the attention
    from there, run with identity projections on them (keys and values both, where either is pooled: they read one
    width), under `mask` where it fits the pooled lengths (unitmask.py's units: each pooled query's own keys); and the
    module that ran it."""
    from attnscope.trace import Trace
    from attnscope.usertrace import fused
    from attnscope.usertrace import reference as ref

    pooled: dict[str, torch.Tensor] = spec.pooled
    parts = dict(projections.linears)
    given = dict(zip("QKV", inputs, strict=True))
    for role in ("Q",) if "Q" in pooled else ():
        given[role] = pooled[role]
    if "K" in pooled or "V" in pooled:
        for role in "KV":
            given[role] = pooled.get(role, trace[f"{role}_feat"])
    for role in (r for r in "QKV" if given[r] is not inputs["QKV".index(r)]):
        width = int(given[role].shape[-1])
        parts[role.lower()] = (f"(your {role}_pooled)", fused.Part(
            f"(your {role}_pooled)", torch.eye(width, dtype=given[role].dtype, device=given[role].device), None))
    reference = ref.build_mha(ref.Projections(parts, projections.matched_by, projections.note), n_head,
                              dataclasses.replace(spec, pooled=None), module, records)
    pooled_mask = fitting(mask, int(given["Q"].shape[-2]), int(given["K"].shape[-2]))
    after = ref.run_mha(reference, given["Q"], given["K"], given["V"], pooled_mask, None,
                        spec.added(cast(int, reference.d_head)))
    out = Trace(notes=list(trace.notes))
    lengths = {"n_Q": int(after["Q_feat"].shape[-2]), "n_K": int(after["K_feat"].shape[-2])}
    for role in "QKV":
        step = trace.step(f"{role}_feat")
        if role in pooled:  # its tokens are the input's: named by the length they share, else n_tokens
            n = int(step.shape[1])
            name = next((d for d, size in lengths.items() if size == n), "n_tokens")
            step = dataclasses.replace(step, dims=(step.dims[0], name, *step.dims[2:]))
        out.add_step(step)
    for role in (r for r in "QKV" if r in pooled):
        made = after.step(f"{role}_feat")
        out.add(f"{role}_pooled", made.tensor, made.dims, f"your code's {role.lower()} pooled along the tokens, as "
                "your run computes it, heads merged", inputs=(f"{role}_feat",))
    for step in after.steps:
        if not step.name.endswith("_feat"):
            out.add_step(step)
    return out, reference


def fitting(mask: torch.Tensor | None, n_q: int, n_k: int) -> torch.Tensor | None:
    """`mask` where it fits n_Q queries and n_K keys (`[.., n_Q, n_K]`, or a key padding `[.., 1, n_K]`), else None:
    a mask of the pooled tokens says nothing of those before the pooling, nor the other way round."""
    if mask is None or mask.dim() == 0:
        return mask
    fits = mask.shape[-1] in (1, n_k) and (mask.dim() < 2 or mask.shape[-2] in (1, n_q))
    return mask if fits else None
