"""What `trace --save` writes: the user's run lined up, under the reference's step names, so that
`attnscope diff` can compare it with another run step by step (a `--save` of any command, or another
trace: eager code against a fused one, a port against the original).

Each reference step the user's code has a tensor for (equal, permuted, or differing: the closest one) is
written under the step's name, in the step's layout (a `[n_batch, n_Q, n_head, d_head]` tensor of the user's is
permuted back to `[n_batch, n_head, n_Q, d_head]`), with its dims, the user's line and op, the user's name for it
and whether it was recomputed (inside a fused kernel). The inputs go under Q, K, V (K and V only where they
differ from Q) and the mask under `mask`, as `mha --save` writes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnscope.usertrace.align import Layout

if TYPE_CHECKING:
    import torch

    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.lined import Aligned
    from attnscope.usertrace.load import Target


def saved_steps(rows: list[Aligned], inputs: Inputs, target: Target) -> tuple[dict[str, torch.Tensor],
                                                                             dict[str, Any]]:
    from attnscope.usertrace.inputs import role_dims

    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    seen: list[torch.Tensor] = []
    for name, tensor in inputs.tensors.items():
        role = inputs.roles[name]
        if any(tensor is t for t in seen):
            continue
        seen.append(tensor)
        dims = role_dims(inputs.side(name), inputs.sizes, "d_feat" in inputs.sizes, inputs.layout)
        tensors[role] = tensor
        meta[role] = {"dims": list(dims) if len(dims) == tensor.dim() else None,
                      "op": f"input {name}: {inputs.ops[name]}"}
    if inputs.allowed is not None:
        tensors["mask"] = inputs.allowed
        meta["mask"] = {"dims": None, "op": "input: the mask, True = may attend"}
    for row in rows:
        record = row.record
        if record is None or row.status not in ("equal", "permuted", "differs") or row.order is None:
            continue
        try:
            tensor = Layout(row.order, row.merged, row.split).undo(record.tensor, tuple(row.shape))
        except RuntimeError:
            continue
        tensors[row.reference] = tensor
        meta[row.reference] = {"dims": list(row.dims), "op": f"{target.source.name} line {record.line}: "
                               f"{record.details.get('op', record.call)}", "user": record.label,
                               "status": row.status, "recomputed": "recomputed" in record.details}
    return tensors, meta
