"""The head count the code itself says, where nothing it holds or is told says it: from the queries it hands the scores
(their layout, their width before the split), from per-head weight stacks, and d_head from the same queries."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record


def from_run(records: list[Record], d_feat: int | None, col: bool = False,
                    n_batch: int | None = None) -> tuple[int, int, str] | None:
    """n_head as the code's own queries say it, and their line: the scores' left operand (a kernel's q) laid out
    [n_batch, n_head, n_Q, d_head], its heads times d_head the module's width; None where they are laid out
    otherwise (heads folded into the batch, grouped in five axes); one head where they have no head axis
    ([n_batch, n_Q, d_attn], [n_Q, d_attn]); folded into the batch, d_feat over their d_head, and laid out
    [.., n_Q, n_head, d_head] (an einsum's 'bqhd'). `col`: the column form's queries, [n_batch, n_head, d_head, n_Q].
    With them, how the queries lay the heads out, in words."""
    from attnscope.usertrace import perhead
    from attnscope.usertrace.flow import operands

    per_head = perhead.find(records)
    if per_head is not None:  # one softmax per head, each with projections of its own
        return len(per_head.roles), per_head.line, f"one softmax per head, {len(per_head.roles)} of them"
    found = operands(records)
    if found is None or not d_feat:
        return None
    q = records[found[0]]
    shape = tuple(q.tensor.shape)
    if len(shape) == 2 and n_batch is None or len(shape) == 3 and shape[0] == n_batch:
        return 1, q.line, "no head axis: one head"  # (and no heads folded into the batch)
    split = _split_width(records, q, n_batch) if len(shape) == 3 and not col else None
    if split is not None:  # heads folded into the batch, counted off the queries before the split (n_head·d_head
        # other than d_feat: perceiver-pytorch's cross_heads·cross_dim_head beside its latent_dim)
        heads = split // shape[-1]
        return heads, q.line, f"[n_batch·n_head, n_Q, d_head] = {list(shape)}, their width before the split / d_head " \
                              f"= {split} / {shape[-1]}"
    if len(shape) == 3 and not col and shape[-1] < d_feat and d_feat % shape[-1] == 0 \
            and shape[0] % (d_feat // shape[-1]) == 0:
        heads = d_feat // shape[-1]  # heads folded into the batch (bmm, baddbmm)
        return heads, q.line, f"[n_batch·n_head, n_Q, d_head] = {list(shape)}, d_feat / d_head = {heads}"
    if len(shape) == 4 and not col and shape[2] * shape[3] == d_feat and shape[1] * shape[3] != d_feat:
        return int(shape[2]), q.line, f"[.., n_Q, {shape[2]}, d_head]"  # an einsum's 'bqhd', Megatron's [s, b, n, d]
    if len(shape) != 4 or shape[1] * shape[2 if col else 3] != d_feat or shape[1] < 1:
        return None
    return int(shape[1]), q.line, f"[.., {shape[1]}, {'d_head, n_Q' if col else 'n_Q, d_head'}]"


def queries_head(records: list[Record], heads: int) -> int | None:
    """d_head of the queries the code hands its scores, where they split their heads: their last axis."""
    from attnscope.usertrace.flow import operands

    found = operands(records)
    if found is None or heads < 1:
        return None
    shape = tuple(records[found[0]].tensor.shape)
    return int(shape[-1]) if len(shape) >= 3 else None


def _split_width(records: list[Record], q: Record, n_batch: int | None) -> int | None:
    """n_head·d_head where the queries `q` ([n_batch·n_head, n_Q, d_head]) were split from [n_batch, n_Q, n_head·d_head]
    and that width is not the module's d_feat alone says: the nearest tensor they come from laid out so, its
    width a whole number of heads that, times n_batch, is their first axis; None where none is seen."""
    from attnscope.usertrace.align import ancestors

    n, d_head = int(q.tensor.shape[1]), int(q.tensor.shape[-1])
    if not n_batch:
        return None
    for i in sorted(ancestors(q, records), reverse=True):
        shape = tuple(records[i].tensor.shape)
        if len(shape) == 3 and shape[:2] == (n_batch, n) and shape[-1] > d_head and shape[-1] % d_head == 0:
            return int(shape[-1]) if n_batch * (shape[-1] // d_head) == q.tensor.shape[0] else None
    return None


def from_weights(module: Any) -> tuple[int, str, tuple[int, ...]] | None:
    """n_head where the module holds its projections as per-head stacks (3-D nn.Parameters, [n_head, d_head, d_in]
    used as W @ x or [n_head, d_in, d_head] as x @ W): the first axis they all share, with the first one's name and
    shape; None where it holds none, or they disagree. A Parameter [1, n, d] is learned tokens broadcast over the
    batch (Set Transformer's seeds, a Q-Former's query tokens), no stack of heads."""
    if module is None:
        return None
    from attnscope.usertrace.inputs import kernel_heads

    stacks = [(name, tuple(p.shape)) for name, p in module.named_parameters() if p.dim() == 3 and p.shape[0] > 1]
    if stacks and (pair := kernel_heads(module)) is not None:  # Keras' kernels [d, n_head, d_head], [n_head, .., d]
        return pair[0], stacks[0][0], stacks[0][1]
    if not stacks or len({shape[0] for _, shape in stacks}) != 1 or stacks[0][1][0] < 1:
        return None
    return stacks[0][1][0], stacks[0][0], stacks[0][1]
