"""Sizes chosen so every named dim differs, and the names of a tensor's axes read back from their sizes.

Sizes not given are chosen so that every named dim has its own size, and no size is the product of two
others (`n_batch·n_head` stays recognizable after a reshape): then each axis of each of the user's
tensors can be named from its size alone. Where sizes collide (given ones, or self-attention, where
n_Q = n_K), the axis is named with every candidate, `n_Q|n_K`, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

# Where the search for a free size starts, per dim (the first free size at or above it is taken).
STARTS = {"n_batch": 2, "n_Q": 6, "n_K": 9, "d_K": 8, "d_V": 10}


def choose_sizes(fixed: dict[str, int], wanted: list[str], given: dict[str, int | None],
                 avoid: tuple[int, ...] = ()) -> dict[str, int]:
    """`fixed` and `given` sizes as they are; every other dim in `wanted` the smallest free size at or above
    its start: not 1, not a size taken (or in `avoid`: sizes named otherwise, a fused projection's width), not
    a product of two taken, and no product with one taken lands on a taken size or product."""
    sizes = dict(fixed)
    sizes.update({name: value for name, value in given.items() if value is not None and name in wanted})
    for name in wanted:
        if name in sizes:
            continue
        size = STARTS.get(name, 2)
        while not _free(size, [*sizes.values(), *avoid]):
            size += 1
        sizes[name] = size
    return sizes


def _free(size: int, taken: list[int]) -> bool:
    taken = [t for t in taken if t > 0]  # a width of 0 (a module built with d=0) names no axis: 0·size is no clash
    products = {a * b for a, b in combinations(taken, 2)}
    used = set(taken) | products | {1}
    return size not in used and all(size * t not in used for t in taken)


@dataclass
class AxisNames:
    """Name an axis from its size: one dim of that size, `a|b` when several, `a·b` for a product of two,
    `1` for a broadcast axis, `?` for a size no dim has."""

    sizes: dict[str, int]
    extra: dict[str, int] = field(default_factory=dict)  # sizes that are no dim (`3·d_feat`), named where free
    singles: dict[int, list[str]] = field(init=False)
    products: dict[int, list[str]] = field(init=False)

    def __post_init__(self) -> None:
        self.singles, self.products = {}, {}
        for name, size in self.sizes.items():
            self.singles.setdefault(size, []).append(name)
        for (a, x), (b, y) in combinations(self.sizes.items(), 2):
            if {a, b} == {"n_head", "n_kv_head"}:
                continue  # no tensor is as wide as one head count times the other (8 of gpt-fast's pairs is d_head/2)
            if x != y or a != b:
                self.products.setdefault(x * y, []).append(f"{a}·{b}")
        for name, size in self.extra.items():
            if size > 1 and size not in self.singles and size not in self.products:
                self.singles[size] = [name]

    def name(self, size: int) -> str:
        if size in self.singles:
            return "|".join(self.singles[size])
        if size == 1:
            return "1"
        if size in self.products:
            return "|".join(self.products[size][:2])
        return "?"

    def dims(self, shape: Any) -> tuple[str, ...]:
        return tuple(self.name(int(n)) for n in shape)
