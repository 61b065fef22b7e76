"""The column form of a module holding weights (Phuong & Hutter's "Formal Algorithms for Transformers", the
column-convention textbooks): one token a column, `Q = W_q X` with X `[.., d, n]`, scores `Kᵀ Q` `[.., n_K, n_Q]`,
the softmax over the keys (dim -2), `out = W_o (V softmax(..))`.

The reference is the row form's, run on the inputs transposed (`rows`), its every step then transposed back
(`columns`): `Q_feat [n_batch, n_Q, d]` is the column form's `[n_batch, d, n_Q]`, the scores `[.., n_Q, n_K]` its
`[.., n_K, n_Q]`. The merge's middle step (`x_rsh1`, heads moved behind the queries) has no column form: heads
`[n_batch, n_head, d_head, n_Q]` merge into `[n_batch, n_head·d_head, n_Q]` by a view alone. Unbatched code
(`[d, n]`) is lined up with a batch of one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from attnscope.trace import Trace

NO_COLUMN_FORM = ("x_rsh1",)


def rows(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Column-form inputs in the row form, `[.., d, n]` -> `[.., n, d]`, and the mask `[.., n_K, n_Q]` ->
    `[.., n_Q, n_K]` (one of fewer than 2 axes as it is)."""
    Q, K, V = (t.transpose(-2, -1) for t in (Q, K, V))  # [.., d, n] -> [.., n, d]
    if mask is not None and mask.dim() >= 2:
        mask = mask.transpose(-2, -1)  # [.., n_K, n_Q] -> [.., n_Q, n_K]
    return Q, K, V, mask


def batched(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unbatched inputs `[n, d]` as a batch of one `[1, n, d]` (the reference's steps keep it: a user's `[d, n]`
    lines up with `[1, d, n]`, its axis of 1 merged away); batched ones as they are."""
    if Q.dim() != 2:
        return Q, K, V
    return Q.unsqueeze(0), K.unsqueeze(0), V.unsqueeze(0)  # [n, d] -> [1, n, d]


def columns(trace: Trace) -> Trace:
    """The row form's steps in the column form: each step's last two axes swapped (and their dims), the merge's
    permute dropped."""
    from attnscope.trace import Trace

    out = Trace(notes=list(trace.notes))
    for step in trace.steps:
        if step.name in NO_COLUMN_FORM:
            continue
        tensor, dims = step.tensor, step.dims
        if tensor.dim() >= 2:
            tensor = tensor.transpose(-2, -1)  # [.., a, b] -> [.., b, a]
            dims = (*dims[:-2], dims[-1], dims[-2])
        out.add(step.name, tensor, dims, step.op, step.flops, step.allocates, inputs=step.inputs)
    return out


def columns_of(skips: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The line-up's skips (per step, the queries that may see no key, `[.., n_Q, 1]`) in the column form,
    `[.., 1, n_Q]`; the merge's middle step has none."""
    # [.., n_Q, 1] -> [.., 1, n_Q]
    return {name: s.transpose(-2, -1) for name, s in skips.items() if name not in NO_COLUMN_FORM and s.dim() >= 2}
