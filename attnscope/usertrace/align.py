"""Line the user's tensors up with the reference's steps.

For each reference step, the user's tensor that equals it: values within tolerance, in the same layout
or in another one, an axis permutation (`[n_batch, n_Q, n_head, d_head]` for `Q_split`) possibly with
neighbouring axes merged (`[n_batch·n_head, n_Q, d_head]`), or one axis viewed as two first (grouped-query scores
`[n_batch, n_kv_head, n_group, n_Q, n_K]`). A permutation that swaps two axes of the same
size is not a layout: shape alone cannot tell them apart, so it is a transposed result (diagnose.py).
The first reference step without an equal is the divergence.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from itertools import permutations
from typing import TYPE_CHECKING

import torch

from attnscope.usertrace.kernels import ATTENTION_KERNELS
from attnscope.usertrace.record import SOFTMAXES

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record

# atol, rtol: "equal" allows what a different order of the same sums gives, and a little more
TOLERANCES = {torch.float64: (1e-10, 1e-7), torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 2e-3),
              torch.bfloat16: (2e-2, 2e-2)}
VERY_NEGATIVE = -1e3  # a user's masked score: -1e9, BERT's -10000 + score or -inf all stand for the reference's -inf
# a user's value past any number attention computes: what a finite fill (finfo.min) becomes where the reference's -inf
# makes inf or NaN (finfo.min times a value, then summed: GPTBigCode's weights filled after the softmax)
OVERFLOWED = 1e30
MAX_PERMUTED_RANK = 6


@dataclass
class Layout:
    """How a user tensor lays out a reference tensor: `split` (axis, a, b) first views one of the reference's axes
    as two, a outer and b inner (n_head as [n_kv_head, n_group] in GQA written as a grouped einsum), `order`
    permutes the axes, then neighbouring axes are merged into the user's shape."""

    order: tuple[int, ...]
    merged: bool
    split: tuple[int, int, int] | None = None

    @property
    def same(self) -> bool:
        return not self.merged and self.split is None and self.order == tuple(range(len(self.order)))

    def source(self, reference_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The reference's shape once `split` has viewed one axis as two."""
        if self.split is None:
            return tuple(reference_shape)
        axis, a, b = self.split
        return (*reference_shape[:axis], a, b, *reference_shape[axis + 1:])

    def describe(self, dims: tuple[str, ...], shape: tuple[int, ...]) -> str:
        if self.same:
            return ""
        if self.split is not None:
            axis = self.split[0]
            parts = ("n_kv_head", "n_group") if dims[axis] == "n_head" else (f"{dims[axis]}₁", f"{dims[axis]}₂")
            dims = (*dims[:axis], *parts, *dims[axis + 1:])
        permuted = [dims[i] for i in self.order]
        if not self.merged:
            return f"as [{', '.join(permuted)}]"
        if len(shape) > len(permuted):  # axes of 1 put in (Hiera's one mask unit, [n_batch, n_head, 1, n, d_head])
            return f"as [{', '.join(permuted)}] with an axis of 1 put in: {list(shape)}"
        return f"as [{', '.join(permuted)}] reshaped to {list(shape)}"

    def apply(self, reference: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        # [the reference's dims, one of them split] -> [those dims in the user's order]
        moved = reference.reshape(self.source(tuple(reference.shape))).permute(self.order)
        return moved.reshape(shape) if self.merged else moved  # merged: [*shape], the user's

    def undo(self, user: torch.Tensor, reference_shape: tuple[int, ...]) -> torch.Tensor:
        """The user's tensor in the reference's layout."""
        source = self.source(tuple(reference_shape))
        permuted = tuple(source[i] for i in self.order)
        inverse = sorted(range(len(self.order)), key=lambda i: self.order[i])
        # [*user.shape] -> [*permuted]: the reference's dims in the user's order -> [*reference_shape]
        return user.reshape(permuted).permute(inverse).reshape(reference_shape)

    def user_axis(self, reference_axis: int) -> int | None:
        """Where a reference axis sits in the user's tensor, counted from the end (None once merged or split)."""
        if self.merged or self.split is not None:
            return None
        return self.order.index(reference_axis % len(self.order)) - len(self.order)


@dataclass
class Match:
    record: Record
    layout: Layout
    max_abs_diff: float
    tolerance: float
    shifted: bool = False  # equal once a constant per query row is taken out (best_shifted): softmax-invariant
    factor: float | None = None  # equal once divided by this number (best_scaled): a scale applied early

    @property
    def equal(self) -> bool:
        return self.max_abs_diff <= self.tolerance


def tolerance(reference: torch.Tensor, dtype: torch.dtype | None = None) -> float:
    """atol + rtol · the largest finite |value| of `reference` cast to `dtype` (its own by default), by that dtype
    (TOLERANCES). A trace asks it of the same tensors thousands of times (each rerun's steps against each record): the
    answer is kept while the tensor lives and is not written to (its version counter)."""
    dtype = reference.dtype if dtype is None else dtype
    key = (id(reference), dtype)
    kept = _TOLERANCES_SEEN.get(key)
    if kept is not None and kept[0]() is reference and kept[1] == reference._version:
        return kept[2]
    atol, rtol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    cast = reference.to(dtype)
    finite = cast[torch.isfinite(cast)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    fills = filled(cast) if scale >= -VERY_NEGATIVE else None
    if fills is not None:  # scores masked by a large number added (−10000 + score): the kept cells' scale (difference
        # meets the masked cells by their sign)
        small = cast[~fills & torch.isfinite(cast)]
        scale = float(small.abs().max()) if small.numel() else 0.0
    value = atol + rtol * scale
    if len(_TOLERANCES_SEEN) < _TOLERANCES_KEPT:
        _TOLERANCES_SEEN[key] = (weakref.ref(reference, _forgotten(key)), reference._version, value)
    return value


def factor_of(user: torch.Tensor, expected: torch.Tensor) -> float | None:
    """The number `user` is `expected` times, where it is one to tolerance; else None."""
    energy = float((expected * expected).sum())
    if not math.isfinite(energy) or energy == 0.0:
        return None
    factor = float((user * expected).sum()) / energy
    if not math.isfinite(factor) or abs(factor) < 1e-6:
        return None
    off = float((user - factor * expected).abs().max())
    return factor if off <= tolerance((expected * factor).float()) else None


def filled(tensor: torch.Tensor) -> torch.Tensor | None:
    """The cells of `tensor` masked by a large finite number (BERT's −10000 + score, −1e9), where it looks like masked
    scores: some cells very negative, the others small beside them (under −VERY_NEGATIVE / 10); None elsewhere (a
    float16 run's scores in the ten thousands are numbers, not a mask)."""
    low = tensor <= VERY_NEGATIVE
    if not bool(low.any()):
        return None
    rest = tensor[~low & torch.isfinite(tensor)]
    return low if not rest.numel() or float(rest.abs().max()) < -VERY_NEGATIVE / 10 else None


def _forgotten(key: tuple[int, torch.dtype]) -> Callable[[weakref.ref], None]:
    """The callback that drops tolerance's kept answer once its tensor dies (its id may then be another's)."""
    return lambda _: _TOLERANCES_SEEN.pop(key, None) and None


# tolerance's answers by (id(tensor), dtype): (a weak reference to it, its version, the tolerance), dropped when it dies
_TOLERANCES_SEEN: dict[tuple[int, torch.dtype], tuple[weakref.ref, int, float]] = {}
_TOLERANCES_KEPT = 65536


def held_tolerance(reference: torch.Tensor, user: torch.Tensor) -> float:
    """The tolerance `user` is judged by: the reference's, or that of the reference in the user's dtype where the
    code computed it in a coarser one (float16, bfloat16), as torch.testing.assert_close takes the tolerances of the
    coarser dtype: a tensor the code computes in float16 holds the step to float16's rounding."""
    if user.dtype in (torch.float16, torch.bfloat16) and reference.dtype not in (torch.float16, torch.bfloat16):
        return max(tolerance(reference), tolerance(reference, user.dtype))
    return tolerance(reference)


def _exchanged(order: tuple[int, ...]) -> tuple[int, ...]:
    """A permutation with the last two axes of its source exchanged wherever they stand."""
    last, before = len(order) - 1, len(order) - 2
    return tuple(before if i == last else last if i == before else i for i in order)


def layouts(reference_shape: tuple[int, ...], user_shape: tuple[int, ...], *, swaps: bool = False) -> list[Layout]:
    """Every layout that turns the reference's shape into the user's, the same one first. Without `swaps`,
    axes of equal size keep their order (swapping them is a transpose, not a layout)."""
    return list(_layouts(tuple(int(n) for n in reference_shape), tuple(int(n) for n in user_shape), swaps))


@functools.lru_cache(maxsize=4096)
def _layouts(reference_shape: tuple[int, ...], user_shape: tuple[int, ...], swaps: bool) -> tuple[Layout, ...]:
    """layouts, once per pair of shapes (a trace compares the same shapes thousands of times)."""
    if math.prod(reference_shape) != math.prod(user_shape) or len(reference_shape) > MAX_PERMUTED_RANK:
        return (Layout(tuple(range(len(reference_shape))), False),) if reference_shape == user_shape else ()
    found = _permuted(reference_shape, user_shape, swaps, None)
    if not found and len(user_shape) > len(reference_shape) - 1 and len(reference_shape) < MAX_PERMUTED_RANK:
        for split in _splits(reference_shape, user_shape):
            found += _permuted(Layout((), False, split).source(reference_shape), user_shape, swaps, split)
    return tuple(found)


def _permuted(source: tuple[int, ...], user_shape: tuple[int, ...], swaps: bool,
              split: tuple[int, int, int] | None) -> list[Layout]:
    found: list[Layout] = []
    for order in permutations(range(len(source))):
        if not swaps and _swaps_equal_sizes(order, source):
            continue
        shape = tuple(source[i] for i in order)
        if shape == user_shape:
            found.append(Layout(order, False, split))
        elif _merges_into(shape, user_shape) and (len(user_shape) < len(shape) or _unsqueezed(shape, user_shape)):
            found.append(Layout(order, True, split))
    return found


def _splits(reference_shape: tuple[int, ...], user_shape: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Each way to view one reference axis as two (a outer, b inner) whose sizes are both among the user's axes:
    the candidates of a layout that splits an axis (n_head as [n_kv_head, n_group])."""
    found = []
    for axis, size in enumerate(reference_shape):
        for a in range(2, size // 2 + 1):
            if size % a == 0 and a in user_shape and size // a in user_shape \
                    and (a != size // a or user_shape.count(a) >= 2):
                found.append((axis, a, size // a))
    return found


def _unsqueezed(shape: tuple[int, ...], user_shape: tuple[int, ...]) -> bool:
    """Whether `user_shape` is `shape` with axes of size 1 put in (Hiera's one mask unit, `[n_batch, n_head, 1, n,
    d_head]`): the same values in the same order."""
    return [n for n in shape if n != 1] == [n for n in user_shape if n != 1] and len(user_shape) > len(shape)


def _swaps_equal_sizes(order: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    return any(shape[a] == shape[b] and a > b for i, a in enumerate(order) for b in order[i + 1:])


def _merges_into(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether `target` groups neighbouring axes of `shape` (sizes of 1 may be anywhere)."""
    source = [n for n in shape if n != 1]
    wanted = [n for n in target if n != 1]
    i = 0
    for size in wanted:
        product = 1
        while i < len(source) and product < size:
            product *= source[i]
            i += 1
        if product != size:
            return False
    return i == len(source)


def difference(user: torch.Tensor, expected: torch.Tensor, skip: torch.Tensor | None = None) -> float:
    """max |user - expected|, with -inf in `expected` met by any very negative user value (a masked score
    written as -1e9), NaN by NaN or ±inf (an inf the reference's identity output projection turned into NaN, inf · 0,
    where the code has none) or by a value past OVERFLOWED, ±inf by an inf or such a value of its sign (the code's
    finite fill where the reference has -inf, carried on), and `skip` (broadcast to `expected`) left out."""
    user, expected = user.double(), expected.double()
    plain_diff = (user - expected).abs() if skip is None else None
    fills = filled(expected)
    if plain_diff is not None and plain_diff.numel():
        plain = float(plain_diff.max())
        # nothing infinite or NaN on either side (max carries a NaN through), nothing masked: no rule applies
        if math.isfinite(plain) and fills is None:
            return plain
    # a masked score: -inf, or a large number added (BERT's −10000 + score, the mask given so), met by any very
    # negative user value
    masked = torch.isneginf(expected) if fills is None else torch.isneginf(expected) | fills
    huge = ~torch.isfinite(user) | (user.abs() >= OVERFLOWED)
    agree = (masked & (user <= VERY_NEGATIVE)) | (torch.isnan(expected) & huge) | (
        torch.isinf(expected) & ((user == expected) | (huge & (user.sign() == expected.sign()))))
    if skip is not None:
        agree = agree | skip
    diff = torch.where(agree, torch.zeros_like(user), (user - expected).abs())
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    return float(diff.max()) if diff.numel() else 0.0


def compare(record: Record, reference: torch.Tensor, skip: torch.Tensor | None = None,
            swaps: bool = False, tol: float | None = None, turned: bool = False) -> list[Match]:
    """Every layout in which `record` could hold `reference`, each with its max |diff|, best first. `turned`: the
    data flow says the record holds the reference's last two axes (the queries' and the keys') the other way round
    (scoreaxes.py), so that swap is a layout though the two have the same size."""
    matches = []
    tol = tolerance(reference) if tol is None else tol
    user = record.tensor
    found = layouts(tuple(reference.shape), tuple(user.shape), swaps=swaps)
    rank = reference.dim()
    if turned and rank >= 2 and reference.shape[-1] == reference.shape[-2]:
        # each layout with the last two axes exchanged, first (their heads merged into the batch too: guided-
        # diffusion's [n_batch·n_head, n_Q, n_K] from einsum("bct,bcs->bts"), the column form's keys first)
        swapped = [Layout(_exchanged(f.order), f.merged, f.split) for f in found]
        found = swapped + [f for f in found if f not in swapped]
    for layout in found:
        expected = layout.apply(reference, tuple(user.shape))
        skipped = layout.apply(skip.expand(reference.shape), tuple(user.shape)) if skip is not None else None
        matches.append(Match(record, layout, difference(user, expected, skipped), tol))
    return sorted(matches, key=lambda m: (not m.equal, not m.layout.same, m.max_abs_diff))


def stands(record: Record) -> bool:
    """Whether `record` may stand for a step: never a snapshot some of whose cells still hold whatever memory held
    (blank.py: `new_empty`'s result, or a slice of it, before the code writes it), which may hold a freed tensor's
    values, the reference's own among them, and so equal a step by chance."""
    return not record.details.get("unwritten")


def best_equal(records: list[Record], reference: torch.Tensor, skip: torch.Tensor | None,
               turned: frozenset[int] = frozenset()) -> Match | None:
    """The user's tensor equal to `reference`: same layout before another, a named one before an unnamed
    one, the earliest of those (the op that made it, not a later copy). `turned`: the records that hold the last
    two axes the other way round (compare)."""
    equal = [m for r in records if stands(r)
             for m in compare(r, reference, skip, tol=held_tolerance(reference, r.tensor), turned=r.index in turned)[:1]
             if m.equal]
    if not equal:
        return None
    return min(equal, key=lambda m: (not m.layout.same, not m.record.names, m.record.index))


# steps a constant per query row leaves the softmax of
PRE_SOFTMAX = ("scores", "capped_scores", "biased_scores", "masked_scores")


def row_spread(user: torch.Tensor, reference: torch.Tensor, axis: int, skip: torch.Tensor | None = None
               ) -> float | None:
    """How far `user - reference` is from a constant along the keys' `axis` (each query row shifted by a number of
    its own, which the softmax takes out: BLOOM's and MPT's ALiBi, `m_h · j` or `m_h · (j − n + 1)` for
    `−m_h · (i − j)`): the largest deviation over the cells both keep. None where they keep other cells (masked:
    -inf, or very negative), or no row keeps two (a constant per row is then anything)."""
    user, reference = user.double(), reference.double()
    kept = torch.isfinite(reference) & (reference > VERY_NEGATIVE)
    theirs = torch.isfinite(user) & (user > VERY_NEGATIVE)
    rows = torch.ones_like(kept) if skip is None else ~skip.expand(reference.shape)
    if not bool(torch.equal(kept & rows, theirs & rows)):
        return None
    kept = kept & rows
    count = kept.sum(axis, keepdim=True)
    if not bool((count >= 2).any()):
        return None
    shift = torch.where(kept, user - reference, 0.0)
    mean = shift.sum(axis, keepdim=True) / count.clamp_min(1)
    return float(torch.where(kept, shift - mean, 0.0).abs().max())


def best_shifted(records: list[Record], reference: torch.Tensor, axis: int, skip: torch.Tensor | None = None,
                 after: int = -1) -> Match | None:
    """The user's tensor (made after record `after`) equal to `reference` plus a constant per query row, in some
    layout, the named and earliest first: a step before the softmax that a convention shifts row by row (the
    softmax takes it out), never a divergence. None where there is none. The tolerance is the kept cells': a mask
    written as a large number added (BERT's −10000 + score) would make it 1 at float32's 1e-4."""
    tol = tolerance(torch.where(torch.isfinite(reference) & (reference > VERY_NEGATIVE), reference, 0.0))
    found = []
    for record in records:
        if record.index <= after or not stands(record) or not record.tensor.is_floating_point() \
                or record.tensor.numel() != reference.numel():
            continue
        for layout in layouts(tuple(reference.shape), tuple(record.tensor.shape)):
            user = layout.undo(record.tensor, tuple(reference.shape))
            spread = row_spread(user, reference, axis, skip)
            if spread is not None and spread <= tol:
                found.append(Match(record, layout, spread, tol, shifted=True))
                break
    if not found:
        return None
    return min(found, key=lambda m: (not m.layout.same, not m.record.names, m.record.index))


# Steps a number multiplies through to the scores: q and k split, normed and rotated are linear in it (RoPE turns
# q · s as it turns q), so code that scales them early (ESM's q · d_head^-0.5 before RoPE, Whisper's d_head^-0.25 on
# each side) holds them times a number, and its scores say whether the numbers make the scale.
SCALABLE = ("Q_split", "K_split", "Q_rot", "K_rot", "K_cat", "K_rep", "Q", "K")


def best_scaled(records: list[Record], reference: torch.Tensor, skip: torch.Tensor | None = None,
                after: tuple[Record, ...] = (), claimed: frozenset[int] = frozenset()) -> Match | None:
    """The user's tensor equal to `reference` times a number other than 1, in some layout, computed from `after`
    (the user's tensors for the steps this one is computed from) and not lined up with another step (`claimed`):
    the step with a scale (or a share of it) applied to it, never a divergence; the scores after it say whether
    the numbers make the scale. The named, same layout and earliest first; None where there is none."""
    expected = reference.double()
    if skip is not None:
        expected = torch.where(skip.expand(reference.shape), 0.0, expected)
    energy = float((expected * expected).sum())
    if not math.isfinite(energy) or energy == 0.0:
        return None
    upstream = [ancestors(r, records) | {r.index} for r in after]
    total = float(expected.sum())
    found = []
    for record in records:
        if record.index in claimed or not stands(record) or not record.tensor.is_floating_point() \
                or record.tensor.numel() != reference.numel():
            continue
        if skip is None:  # a layout keeps the sums: Σu² = c² Σe² and Σu = c Σe, whatever the layout
            theirs = record.tensor.double()
            size = math.sqrt(float((theirs * theirs).sum()) / energy)
            if not any(abs(float(theirs.sum()) - c * total) <= 1e-3 * (abs(c) * math.sqrt(energy) + 1e-12)
                       * math.sqrt(reference.numel()) for c in (size, -size)):
                continue
        if after and not all(up <= ancestors(record, records) | {record.index} for up in upstream):
            continue
        for layout in layouts(tuple(reference.shape), tuple(record.tensor.shape)):
            user = layout.undo(record.tensor, tuple(reference.shape)).double()
            if skip is not None:
                user = torch.where(skip.expand(reference.shape), 0.0, user)
            factor = float((user * expected).sum()) / energy
            if not math.isfinite(factor) or abs(factor) < 1e-6 or math.isclose(factor, 1.0, rel_tol=1e-4):
                continue
            tol = tolerance(reference * factor)
            off = float((user - factor * expected).abs().max())
            if off <= tol:
                found.append(Match(record, layout, off, tol, factor=factor))
                break
    if not found:
        return None
    return min(found, key=lambda m: (not m.layout.same, not m.record.names, m.record.index))


def candidates(records: list[Record], reference: torch.Tensor, name: str, skip: torch.Tensor | None = None,
               anchor: int = -1, used: frozenset[int] = frozenset(), turned: frozenset[int] = frozenset()
               ) -> list[Match]:
    """The user's tensors that have `reference`'s shape (or a layout of it) though none equals it, most likely
    meant first: one not already lined up with an earlier step (`used`), the one the user gave the same name
    (a recomputed step counts under its own), then named ones, the same layout, the nearest values, then the
    nearest in order to `anchor` (the user's tensor that matched the step before)."""
    tol = tolerance(reference)
    found = [m for r in records if stands(r)
             for m in compare(r, reference, skip, tol=tol, turned=r.index in turned)[:1]]
    return sorted(found, key=lambda m: (m.record.index in used, not _named(m.record, name), not m.record.names,
                                        not m.layout.same, m.max_abs_diff, abs(m.record.index - anchor)))


def _named(record: Record, name: str) -> bool:
    return name in record.names or f"({name})" in record.names  # (scores): recomputed inside a kernel


def closest(records: list[Record], reference: torch.Tensor, name: str, skip: torch.Tensor | None = None,
            anchor: int = -1, claimed: frozenset[int] = frozenset(), turned: frozenset[int] = frozenset()
            ) -> Match | None:
    """The likeliest of `candidates`, never a tensor already lined up with another step (`claimed`)."""
    ranked = [m for m in candidates(records, reference, name, skip, anchor, turned=turned)
              if m.record.index not in claimed]
    return ranked[0] if ranked else None


# The ops that make each step (Record.func), beside those that hand their input on (`.float()`, `.contiguous()`).
MAKES = {
    "scores": ("matmul", "bmm", "baddbmm", "einsum", "div", "mul", "true_divide", "recomputed"),
    "masked_scores": ("masked_fill", "masked_fill_", "add", "where", "__setitem__", "sub", "recomputed", "baddbmm",
                      "addbmm"),
    "attention": ("softmax", "_softmax", "dropout", "div", "mul", "recomputed"),
    "x_raw": ("matmul", "bmm", "einsum", *ATTENTION_KERNELS, "multi_head_attention_forward", "vmap"),
    "out": ("matmul", "bmm", "einsum", *ATTENTION_KERNELS, "vmap"),
    "x_rsh1": ("permute", "transpose", "contiguous", "movedim", "swapaxes", "einsum"),
    "x_rsh2": ("view", "reshape", "flatten", "contiguous", "_unsafe_view"),
    "x": ("linear", "matmul", "add", "einsum", "multi_head_attention_forward"),
    "K_rep": ("repeat", "repeat_interleave", "expand", "reshape", "view", "index_select", "cat", "flatten"),
    "V_rep": ("repeat", "repeat_interleave", "expand", "reshape", "view", "index_select", "cat", "flatten"),
}
FUSED_WITH_SCORES = ("masked_scores", "biased_scores")
ADDS_A_MASK = ("baddbmm", "addbmm", "addmm")


def adds_a_bias(record: Record) -> bool:
    """An op of ADDS_A_MASK that adds its first argument (beta not 0): the product and the bias in one tensor."""
    return record.func in ADDS_A_MASK and not any(kind == "text" and str(text).replace(" ", "") in
                                                  ("beta=0", "beta=0.0") for kind, text in record.args)


PASSING = ("contiguous", "float", "to", "type_as", "clone", "half", "bfloat16", "double")


def follow(records: list[Record], reference: torch.Tensor, name: str, after: list[Record],
           skip: torch.Tensor | None = None, claimed: frozenset[int] = frozenset(),
           avoid: frozenset[int] = frozenset(), turned: frozenset[int] = frozenset()) -> Match | None:
    """The user's tensor that stands where step `name` stands in the data flow, when none equals it: one computed
    from `after` (the user's tensors lined up with the steps it is computed from; a step recomputed inside a kernel
    stands for the kernel's arguments), of its shape or a layout of it, not lined up with another step (`claimed`),
    the one the user gave its name, then one made by an op that makes such a step before one that hands its input
    on, a named one, the same layout, the nearest in order. Never one computed from `avoid` (the user's tensors for
    steps this one is not computed from: K_rep is no tensor the queries went into). None when no such tensor exists:
    the step is not found, rather than paired with a tensor of the same shape elsewhere."""
    need = [set(r.parents) if r.func == "recomputed" else {r.index} for r in after]
    upstream = set().union(*(ancestors(r, records) | {r.index} for r in after))
    avoid = frozenset(avoid - upstream)
    makes = MAKES.get(name)
    found = []
    for record in records:
        # diffusers' baddbmm(mask, q, kᵀ) adds the mask as it makes the scores: one op stands for both steps
        adds = name in FUSED_WITH_SCORES and record.func in ADDS_A_MASK and record in after
        if ((record.index in claimed or record.index <= max(r.index for r in after)) and not adds) \
                or not stands(record):
            continue
        if makes is not None and record.func not in makes and record.func not in PASSING:
            continue
        origin = ancestors(record, records) | {record.index}
        if not all(n <= origin for n in need) or origin & avoid:
            continue
        found += [(m, record.func in PASSING or record.details.get("same")) for m in
                  compare(record, reference, skip, turned=record.index in turned)[:1]]
    if not found:
        return None
    return min(found, key=lambda f: (not _named(f[0].record, name), bool(f[1]), not f[0].record.names,
                                     not f[0].layout.same, f[0].record.index))[0]


def ancestors(record: Record, records: list[Record]) -> set[int]:
    """The records `record` was computed from, directly or not."""
    seen: set[int] = set()
    stack = list(record.parents)
    while stack:
        index = stack.pop()
        if index not in seen:
            seen.add(index)
            stack.extend(records[index].parents)
    return seen


# The ops that only rearrange their input's values: a tensor made from a step by these alone holds that step's
# numbers, in some layout or in a wrong one.
REARRANGING = ("view", "reshape", "transpose", "permute", "movedim", "swapaxes", "flatten", "unflatten",
               "_unsafe_view", "contiguous", "unsqueeze", "squeeze") + PASSING


def rearranged_wrongly(records: list[Record], start: Record, upto: Record, reference: torch.Tensor,
                       skip: torch.Tensor | None = None) -> Match | None:
    """The first user tensor made from `start` (lined up with the step `reference` is) by rearranging ops alone,
    on the way to `upto` in the data flow, that has the step's shape (or a layout of it) yet equals it in no layout,
    axes of the same size swapped included: there the step goes wrong (heads split by a view without the
    transpose), though `start` itself holds the step's numbers. None when every such tensor is the step."""
    made = {start.index}
    before = ancestors(upto, records)
    for record in records[start.index + 1:upto.index]:
        if record.func not in REARRANGING or not record.parents or record.parents[0] not in made:
            continue
        made.add(record.index)
        if record.index not in before:
            continue
        tol = max(tolerance(reference), tolerance(reference, record.tensor.dtype))  # after a cast, its precision
        matches = compare(record, reference, skip, swaps=True, tol=tol)
        if matches and not any(m.equal for m in matches):
            return matches[0]
    return None


SCALING = ("mul", "__mul__", "__rmul__", "mul_", "div", "__truediv__", "true_divide", "div_")


def rescaled(records: list[Record], start: Record, reference: torch.Tensor,
             skip: torch.Tensor | None = None) -> Match | None:
    """The last user tensor made from `start` (lined up with the step `reference` is) by multiplying or dividing by
    a number alone, on the way to a softmax, when it equals the step in no layout: the scores scaled again after
    they were right (`einsum(...) * self.scale * self.scale`). None when there is none, or it is the step."""
    made, last = {start.index}, None
    for record in records[start.index + 1:]:
        if record.func in SCALING and len(record.parents) == 1 and record.parents[0] in made \
                and record.tensor.shape == start.tensor.shape:
            made.add(record.index)
            last = record
    if last is None or not any(r.func.split(".")[-1] in SOFTMAXES and last.index in ancestors(r, records)
                               for r in records[last.index + 1:]):
        return None
    if any(r.func.split(".")[-1] == "tanh" and last.index in r.parents for r in records[last.index + 1:]):
        return None  # the softcap's own division, C · tanh(scores / C): not the scores scaled again
    matches = compare(last, reference, skip)
    return matches[0] if matches and not any(m.equal for m in matches) else None
