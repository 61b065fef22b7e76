"""ALiBi handed in the mask: under --alibi, code that takes neither ALiBi's bias nor a bias parameter, builds no
position bias of its own and adds its mask argument to its scores (Baichuan-13B's `attn_weights + attention_mask`,
the mask its model's `_gen_alibi_mask` builds: `m_h · j` plus -inf above the diagonal, [n_head, n, n]) is handed
ALiBi's bias and the mask merged, one additive tensor, as such a model hands it.

Read from the run with the mask alone (0 / -inf, as the code reads it): the op that adds the mask to the scores says how
the scores are laid out, `[n_batch, n_head, n_Q, n_K]` (the bias then `[n_head, n_Q, n_K]`, or `[n_batch, n_head, n_Q,
n_K]` where the mask holds the batch), `[n_batch, n_kv_head, n_group, n_Q, n_K]` (grouped heads) or `[n_batch·n_head,
n_Q, n_K]` (heads folded into the batch, each sequence's side by side); a mask handed to
`F.scaled_dot_product_attention` as `attn_mask` meets the scores the kernel makes (its float form then given). A
position bias of the code's own is found by experiment: the scores it softmaxes, less the product of q and k times the
scale that fits them best, keep a term the same in every sequence and not zero (its own ALiBi, merged into the mask or
not): the code is then left as it is, its bias compared with the reference's, and a mistake in it named.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from attnscope.usertrace.kernels import ATTENTION_KERNELS
from attnscope.usertrace.masking import ADDS

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from attnscope.usertrace.call import Called
    from attnscope.usertrace.record import Record

ADDITIVE = ("additive", "additive_min")  # the mask conventions that add it to the scores
FILLED = 1e4  # scores this large are a mask's fill (HF's -10000.0 and beyond), never a bias of the positions
PURE_PRODUCTS = ("matmul", "__matmul__", "__rmatmul__", "bmm", "mm", "einsum")


def merged(records: list[Record], label: str, given: torch.Tensor, kind: str, sizes: dict[str, int],
           rerun: Callable[[torch.Tensor], Called]) -> tuple[torch.Tensor, tuple[str, ...]] | None:
    """The mask `given` (additive, as the code reads it, or a boolean a kernel takes as `attn_mask`, written as its 0 /
    -inf; `records` the run on it) with ALiBi's bias added, laid out as the scores it meets, and its dims; None where
    the code does not add it to its scores, adds a position bias of its own (read from `rerun`, the code run on a mask
    that masks nothing), or its scores are laid out in no way read here."""
    import torch

    from attnscope import masks
    from attnscope.variants import alibi

    added = _added(records, label)
    nothing = torch.zeros_like(given) if given.is_floating_point() else torch.ones_like(given)  # masks nothing
    if added is not None and added.label == "(scores)" and given.dtype == torch.bool and kind == "attend":
        # a kernel's boolean attn_mask (SDPA's): its float form, 0 / -inf, is added to the scores as well
        given, kind = masks.to_additive(given).to(added.tensor.dtype), "additive"
    if kind not in ADDITIVE or not given.is_floating_point():
        return None
    n_head, n_Q, n_K, n_batch = sizes.get("n_head", 0), sizes.get("n_Q", 0), sizes.get("n_K", 0), \
        sizes.get("n_batch", 1)
    laid = _laid(alibi.bias(n_head, n_Q, n_K, n_K - n_Q).double(), tuple(added.tensor.shape), n_batch) \
        if added is not None and n_head > 0 and n_Q and n_K else None
    if laid is None:
        return None
    bare = rerun(nothing)
    if bare.failure is not None or own_bias(bare.records, n_batch):
        return None
    bias, dims = laid
    out = given.double() + bias
    while out.dim() > max(given.dim(), 3) and out.shape[0] == 1:  # [1, n_head, ..] as [n_head, ..], Baichuan's
        out, dims = out[0], dims[1:]
    if dims[0] == "1" and out.shape[0] != 1:  # the mask holds the batch: [n_batch, n_head, n_Q, n_K]
        dims = ("n_batch", *dims[1:])
    out = out.to(given.dtype)
    if kind == "additive_min":
        out = out.clamp(min=torch.finfo(given.dtype).min)
    return out, dims


def _added(records: list[Record], label: str) -> Record | None:
    """The op that adds the mask (or a tensor made of it alone) to the scores: an add whose other operand is a
    record of the code's, not made of the mask, holding the scores' last two axes; for an attention kernel given it
    as `attn_mask` (SDPA's), the scores recomputed beside the kernel."""
    from attnscope.usertrace.paramuse import derived

    made = derived(records, label)
    by_index = {r.index: r for r in records}
    for record in records:
        if record.func in ATTENTION_KERNELS and any(_reads_mask(a, label, made) for a in record.args[3:]):
            # F.scaled_dot_product_attention(q, k, v, attn_mask=mask): its scores as recomputed beside it
            return next((r for r in records if r.label == "(scores)" and r.index < record.index
                         and set(r.parents) == set(record.parents)), None)
        if record.func not in ADDS or record.tensor.dim() < 3:
            continue
        operands = [a for a in record.args if a[0] in ("rec", "text")]
        mine = [a for a in operands if (a[0] == "text" and a[1] == label) or (a[0] == "rec" and a[1] in made)]
        other = [by_index.get(a[1]) for a in operands if a[0] == "rec" and a[1] not in made]
        if mine and other and other[0] is not None and other[0].tensor.shape[-2:] == record.tensor.shape[-2:]:
            return record
    return None


def _reads_mask(arg: tuple[str, Any], label: str, made: set[int]) -> bool:
    """Whether a kernel's argument (positional or `attn_mask=`) is the mask or a tensor made of it."""
    kind, value = arg
    if kind == "kw":
        return value[0] == "attn_mask" and _reads_mask(value[1], label, made)
    return kind == "text" and value == label or kind == "rec" and value in made


def _laid(bias: torch.Tensor, scores: tuple[int, ...], n_batch: int) -> tuple[torch.Tensor, tuple[str, ...]] | None:
    """ALiBi's `[n_head, n_Q, n_K]` laid out to broadcast over scores shaped `scores`, with its dims."""
    n_head = bias.shape[0]
    if len(scores) == 3 and scores[0] == n_batch * n_head:  # heads folded into the batch, b·n_head + h
        return bias.repeat(n_batch, 1, 1), ("n_batch·n_head", "n_Q", "n_K")
    if len(scores) == 3 and scores[0] == n_head:
        return bias, ("n_head", "n_Q", "n_K")
    middle = scores[1:-2]
    if len(middle) in (1, 2) and math.prod(middle) == n_head:  # [n_batch, n_head, ..]; grouped: n_kv_head, n_group
        return bias.reshape(1, *middle, *bias.shape[1:]), ("1", *(("n_head",) if len(middle) == 1 else
                                                                  ("n_kv_head", "n_group")), "n_Q", "n_K")
    return None


def own_bias(records: list[Record], n_batch: int) -> bool:
    """Whether the scores the code softmaxes (run on a mask that masks nothing) hold a position bias of its own: less
    the product of q and k times the scale that fits them (least squares over the differences between the sequences,
    which a bias of the positions leaves out), a term that is not zero and is the same in every sequence."""
    import torch

    from attnscope.usertrace.masking import is_pattern

    by_index = {r.index: r for r in records}
    pattern = next((r for r in records if is_pattern(r) and r.parents), None)
    if pattern is not None and pattern.label == "(attention)":  # a kernel's, recomputed: its scores before the mask
        scores = next((r for r in records if r.label == "(masked_scores)" and r.parents == pattern.parents), None)
        plain = next((r for r in records if r.label == "(scores)" and r.parents == pattern.parents), None)
        product = plain.tensor if plain is not None else None
    else:
        scores = by_index.get(pattern.parents[0]) if pattern is not None else None
        product = _product(scores, by_index) if scores is not None else None
    if scores is None or product is None or product.numel() != scores.tensor.numel() \
            or n_batch < 2 or product.numel() % n_batch:
        return False
    s = scores.tensor.detach().double().reshape(n_batch, -1)
    p = product.detach().double().reshape(n_batch, -1)
    # a mask's fill of the code's own (-1e4, -1e9, finfo.min) masks a cell, no bias of the positions
    kept = (torch.isfinite(s) & (s.abs() < FILLED) & torch.isfinite(p)).all(0)
    if not bool(kept.any()):
        return False
    s, p = s[:, kept], p[:, kept]
    ds, dp = s - s[:1], p - p[:1]
    scale = float((ds * dp).sum() / (dp * dp).sum().clamp(min=1e-30))
    rest = s - scale * p
    top = float(s.abs().max())
    if float(rest.abs().max()) <= 1e-4 * max(top, 1e-12):
        return False
    return bool(torch.allclose(rest, rest[:1].expand_as(rest), rtol=1e-3, atol=1e-4 * max(top, 1e-12)))


def _product(record: Record, by_index: dict[int, Record]) -> torch.Tensor | None:
    """q · kᵀ as the code computes it: the nearest product among the ancestors of `record` (a baddbmm's product
    recomputed from its two factors, its added term left out)."""
    seen, todo = set(), [record.index]
    while todo:
        index = todo.pop(0)
        if index in seen or index not in by_index:
            continue
        seen.add(index)
        found = by_index[index]
        if found.func in PURE_PRODUCTS:
            return found.tensor
        if found.func == "baddbmm":
            factors = [by_index.get(a[1]) for a in found.args if a[0] == "rec"][1:3]
            if len(factors) == 2 and all(f is not None for f in factors):
                return factors[0].tensor @ factors[1].tensor  # type: ignore[union-attr]
            return None
        todo.extend(found.parents)
    return None


def note(label: str, dims: tuple[str, ...], line: int | None) -> str:
    """What the run's note says the mask parameter was given."""
    words = f"[{', '.join(dims)}]"
    where = f" (line {line})" if line else ""
    return (f"{label}: given ALiBi's bias (--alibi, −m_h · (i − j), the reference's slopes) and the mask merged "
            f"into one additive tensor {words}, as Baichuan's model hands it: your code takes no ALiBi of its own nor "
            f"a bias parameter, and adds this mask to its scores{where}")
