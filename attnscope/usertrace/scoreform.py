"""How the code writes its scores, read from its run: which operand of the product that makes them holds the keys
(the operand whose tokens the product with the values contracts, the pattern followed through its transposes:
scoreaxes.walk), and so whether the code computes `Kᵀ Q` or `Qᵀ K` in the column form, and which of the scores'
last two axes holds the keys. latent-diffusion's `w_ = torch.bmm(q, k)` (q permuted to [b, hw, c]) then
`torch.bmm(v, w_.permute(0, 2, 1))` is `Qᵀ K` `[.., n_Q, n_K]`; a textbook's `K.T @ Q` then `V @ A` is `Kᵀ Q`
`[.., n_K, n_Q]`, as is `einsum("bhdk,bhdq->bhkq", k, q)` contracted over its k."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnscope.usertrace.record import SOFTMAXES
from attnscope.usertrace.scoreaxes import KERNEL_STEPS, Labels, equation, operands, product_above, walk

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record

LEFT, RIGHT = "q", "k"  # the labels walk follows: here the product's first operand's axes, and its second's


def keys_left(records: list[Record], product: Record, value_product: Record) -> bool | None:
    """Whether the scores' product holds the keys in its left operand, read from the product with the values: that
    product contracts the pattern over the keys' axis, so the operand whose tokens it contracts is the keys'. None
    where the axes cannot be followed from the one to the other."""
    labels = _sides(product)
    if labels is None:
        return None
    side = walk(records, product, labels)[1].get(value_product.index)
    return None if side is None else side == LEFT


def written(records: list[Record]) -> tuple[str, str] | None:
    """The scores as the code computes them, in the column form's words: ("Kᵀ Q", "[.., n_K, n_Q]") where the keys
    are the left operand of the product and its rows, ("Qᵀ K", "[.., n_Q, n_K]") where they are the right and its
    columns (either formula with the axes the other way where an einsum lays them so); None where no product makes
    the scores or the product with the values cannot be followed to them; a fused kernel's, SDPA's `q kᵀ` on heads
    laid as rows, is `Qᵀ K`."""
    by_index = {r.index: r for r in records}
    for softmax in (r for r in records if r.func.split(".")[-1] in SOFTMAXES):
        product = product_above(softmax, by_index)
        labels = _sides(product) if product is not None else None
        if product is None or labels is None:
            continue
        contracted = walk(records, product, labels)[1]
        side = next((c for i, c in sorted(contracted.items()) if i > softmax.index and c is not None), None)
        if side is None:
            continue
        formula = "Kᵀ Q" if side == LEFT else "Qᵀ K"
        return formula, "[.., n_Q, n_K]" if labels[-1] == side else "[.., n_K, n_Q]"
    if any(r.style == "recomputed" and KERNEL_STEPS & set(r.names) for r in records):
        return "Qᵀ K", "[.., n_Q, n_K]"  # a fused kernel's (SDPA's q kᵀ on heads laid as rows)
    return None


def _sides(product: Record) -> Labels | None:
    """The product's axes, each labelled by the operand that keeps it (LEFT: the first, RIGHT: the second); None
    where its two operands or their kept axes cannot be read."""
    if len(operands(product)) != 2:
        return None
    rank = product.tensor.dim()
    if product.func.split(".")[-1] != "einsum":
        return (*([None] * (rank - 2)), LEFT, RIGHT) if rank >= 2 else None  # the left's rows, the right's columns
    spec = equation(product)
    if spec is None or len(spec[0]) != 2 or len(spec[1]) != rank:
        return None
    owners = [[i for i, sub in enumerate(spec[0]) if letter in sub] for letter in spec[1]]
    labels = tuple((LEFT, RIGHT)[own[0]] if len(own) == 1 else None for own in owners)
    return labels if sorted(x for x in labels if x is not None) == sorted([LEFT, RIGHT]) else None


def said(records: list[Record]) -> str:
    """The column convention's scores in words, as the code computes them (`written`): "scores Qᵀ K [.., n_Q, n_K],
    softmax over the keys, dim -1" for latent-diffusion's; the textbook's `Kᵀ Q` where the run does not say."""
    formula, axes = written(records) or ("Kᵀ Q", "[.., n_K, n_Q]")
    return f"scores {formula} {axes}, softmax over the keys, dim {-1 if axes.endswith('n_K]') else -2}"
