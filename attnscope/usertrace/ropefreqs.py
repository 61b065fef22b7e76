"""How fast each RoPE pair turns, read from the code's rotated tensors where no base gives it: a frequency table of
the code's own. modded-nanogpt's half-truncated RoPE turns the first quarter of its pairs at `(1/1024)^linspace(0,
1)` and leaves the rest still (frequency 0); other code spreads its frequencies over another exponent, or rotates
some pairs only. None of these is `base^(-2i/d)` for any base, yet each is a RoPE: q·k depends on i − j alone.

Each pair's angle at each position is read from the code's rotated tensor against the reference's unrotated one (in
float64, all rows at once); a pair's frequency is the angle it turns from one position to the next, and the
reading holds only where every position's angle is that frequency times the position (the first at the reference's
first position), for every pair. The direction comes with it: pairs that turn by −θ have negative frequencies
(nanochat's, the speedrun's `x1·cos + x2·sin`); all of one sign, or the reading is none (code that turns pairs
both ways). Frequencies of more than π a position cannot be told from their alias and are not read (RoPE's are 1
and less). A table of zeros is no rotation at all (`rope.not_applied` stays a bug).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

STILL = 1e-6  # a pair turning less than this a position is read as still (frequency 0)
ANGLE_TOL = 2e-3  # radians: every position's angle agrees with the frequency's to this


@dataclass(frozen=True)
class Table:
    """The frequency of each rotated pair (the first `width` coordinates, paired as `pairing` says), the direction
    they turn (1: +θ, -1: −θ)."""

    freqs: tuple[float, ...]
    sign: int

    def words(self) -> str:
        still = [i for i, f in enumerate(self.freqs) if f == 0.0]
        moving = [f for f in self.freqs if f != 0.0]
        shown = ", ".join(f"{f:.3g}" for f in moving[:4]) + (", ..." if len(moving) > 4 else "")
        rest = f"; {len(still)} of its {len(self.freqs)} pairs do not turn at all (frequency 0, pairs " \
               f"{_spans(still)})" if still else ""
        return (f"it turns its {len(moving)} rotated pairs at frequencies of its own, {shown} radians a position, "
                f"which no RoPE base gives (base^(−2i/d)){rest}")


def pair_turns(source: torch.Tensor, mine: torch.Tensor, pairing: str, width: int, pair: int) -> torch.Tensor:
    """The angle the code turned pair `pair` (of the first `width` coordinates) by at each position `[n]`."""
    half = width // 2
    a, b = (pair, pair + half) if pairing == "half-split" else (2 * pair, 2 * pair + 1)
    x = torch.complex(source[..., a], source[..., b]).flatten(0, -2)  # [.., n]
    u = torch.complex(mine[..., a], mine[..., b]).flatten(0, -2)
    return torch.angle((u * x.conj()).sum(0))


def read(source: torch.Tensor, mine: torch.Tensor, pairing: str, width: int, first: int) -> Table | None:
    """The table under which `mine` is `source` (`[.., n, d]`, float64) rotated, its first row at position `first`;
    None where some pair's angles are no frequency times the position, the pairs turn both ways or none turns."""
    n = source.shape[-2]
    if n < 2 or width < 2 or width % 2 or width > source.shape[-1]:
        return None
    positions = torch.arange(first, first + n, dtype=torch.float64)
    freqs = []
    for pair in range(width // 2):
        turned = pair_turns(source, mine, pairing, width, pair)  # [n]
        steps = _wrapped(turned[1:] - turned[:-1])
        frequency = float(steps.mean())
        if float((steps - frequency).abs().max()) > ANGLE_TOL \
                or float(_wrapped(turned - frequency * positions).abs().max()) > ANGLE_TOL:
            return None
        freqs.append(0.0 if abs(frequency) < STILL else frequency)
    moving = [f for f in freqs if f != 0.0]
    if not moving or (any(f > 0 for f in moving) and any(f < 0 for f in moving)):
        return None
    sign = 1 if moving[0] > 0 else -1
    return Table(tuple(abs(f) for f in freqs), sign)


def from_code(records: list[Any], q: torch.Tensor, k: torch.Tensor, first: int) -> tuple[Table, str] | None:
    """The table and pairing under which the queries and keys the code hands its scores (its operands, in any
    layout, each head row perhaps scaled: a norm or a scale keeps the angles) are the reference's unrotated `q` and
    `k` (`[.., n, d]`) rotated, both alike, the first at `first`; None where they are not so."""
    from attnscope.usertrace.flow import operands

    handed = operands(records)
    if handed is None:
        return None
    for pairing in ("half-split", "interleaved"):
        tables = [_read_any(records[index].tensor, x, pairing, first) for index, x in zip(handed[:2], (q, k),
                                                                                          strict=True)]
        if tables[0] is not None and tables[1] is not None and tables[0].sign == tables[1].sign \
                and all(math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-6)
                        for a, b in zip(tables[0].freqs, tables[1].freqs, strict=True)):
            return tables[0], pairing
    return None


def _read_any(tensor: Any, reference: torch.Tensor, pairing: str, first: int) -> Table | None:
    """The table read from the code's tensor in the first layout of the reference's shape that gives one."""
    from attnscope.usertrace.align import layouts

    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        return None
    shape = tuple(reference.shape)
    for layout in layouts(shape, tuple(tensor.shape)):
        try:
            mine = layout.undo(tensor, shape).double()
        except RuntimeError:
            continue
        table = read(reference.double(), mine, pairing, shape[-1], first)
        if table is not None:
            return table
    return None


def is_base(table: Table, base: float, width: int) -> bool:
    """Whether the table is `base`'s own, base^(−2i/width), which the readings by base already cover."""
    return all(math.isclose(f, base ** (-2 * i / width), rel_tol=1e-4) for i, f in enumerate(table.freqs))


def _wrapped(angle: torch.Tensor) -> torch.Tensor:
    return torch.remainder(angle + math.pi, 2 * math.pi) - math.pi


def _spans(indices: list[int]) -> str:
    """`[4, 5, 6, 7]` -> "4 to 7"; `[1, 3]` -> "1, 3"."""
    if indices == list(range(indices[0], indices[-1] + 1)) and len(indices) > 2:
        return f"{indices[0]} to {indices[-1]}"
    return ", ".join(str(i) for i in indices)
