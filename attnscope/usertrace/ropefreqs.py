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

Where no one 1-D position gives the angles, the angle each token's pair turns by is read whole, a table `[n, pairs]`
(`Angles`): 2-D or axial RoPE (EVA-02's VisionRotaryEmbeddingFast, DINOv3's, Pixtral's vision encoder, Qwen2-VL's
vision rotary and M-RoPE) turns some pairs by a token's row and others by its column; a cls token or registers kept
aside turn by nothing. It is read where it has RoPE's structure alone: the code's tensor is the unrotated one with
each pair turned by an angle of its token and pair (not of the values: every row of every batch and head turned
alike, up to one gain, the scale that may follow), and the queries and keys turned by the same table. A table whose
every pair moves evenly from token to token is a 1-D RoPE, which the readings by base and frequency cover (and whose
other base or positions stay bugs); a table read for the queries that the keys do not share is no convention.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
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

    def base(self) -> float | None:
        """The base whose frequencies these are, base^(−2i/d) for pair i of the d = 2·pairs coordinates rotated
        (LlamaRotaryEmbedding's inv_freq over its rotary width), to 1e-3; None where no base gives them."""
        n = len(self.freqs)
        if n < 2 or any(f <= 0.0 for f in self.freqs) or not math.isclose(self.freqs[0], 1.0, rel_tol=1e-3):
            return None
        base = self.freqs[1] ** (-n)  # f_1 = base^(−2/d), d = 2n
        if not all(math.isclose(f, base ** (-i / n), rel_tol=1e-3) for i, f in enumerate(self.freqs)):
            return None
        return base

    def words(self) -> str:
        still = [i for i, f in enumerate(self.freqs) if f == 0.0]
        moving = [f for f in self.freqs if f != 0.0]
        shown = ", ".join(f"{f:.3g}" for f in moving[:4]) + (", ..." if len(moving) > 4 else "")
        base = self.base()
        if base is not None:
            return (f"it turns its {len(moving)} rotated pairs at frequencies {shown} radians a position: "
                    f"base {base_words(base)}, base^(−2i/d)")
        rest = f"; {len(still)} of its {len(self.freqs)} pairs do not turn at all (frequency 0, pairs " \
               f"{_spans(still)})" if still else ""
        return (f"it turns its {len(moving)} rotated pairs at frequencies of its own, {shown} radians a position, "
                f"which no RoPE base gives (base^(−2i/d)){rest}")


def base_words(base: float) -> str:
    """A base read from frequencies, as a user writes it: 2000000, not 2e+06 (its own digits where it has some)."""
    whole = round(base)
    return str(whole) if abs(base - whole) <= 1e-3 * base else f"{base:.6g}"


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
    for each in _unrepeated(tensor, reference):
        for layout in layouts(shape, tuple(each.shape)):
            try:
                mine = layout.undo(each, shape).double()
            except RuntimeError:
                continue
            table = read(reference.double(), mine, pairing, shape[-1], first)
            if table is not None:
                return table
    return None


def _unrepeated(tensor: torch.Tensor, reference: torch.Tensor) -> list[torch.Tensor]:
    """`tensor`, and where it holds a whole number n_group > 1 of the reference's (keys handed the scores repeated
    for grouped-query attention, `[.., n_head, n, d]` against `[.., n_kv_head, n, d]`), each axis that could be the
    heads' taken once a group: the first of each group of n_group (transformers' repeat_kv) and the first n_kv_head
    (the heads tiled)."""
    import torch

    if tensor.numel() <= reference.numel() or tensor.numel() % reference.numel():
        return [tensor]
    group = tensor.numel() // reference.numel()
    out = [tensor]
    for axis in range(tensor.dim() - 1):  # never the last: a head's coordinates
        n = int(tensor.shape[axis])
        if n % group == 0 and n > group - 1:
            out += [tensor.index_select(axis, torch.arange(0, n, group)), tensor.narrow(axis, 0, n // group)]
    return out


@dataclass(frozen=True)
class Angles:
    """The angle each token's rotated pair turns by, `table` `[n, d_head/2]` float64 (pairs as `pairing` says), read
    from the code's queries and keys alike."""

    table: torch.Tensor
    pairing: str

    def words(self) -> str:
        still = [i for i in range(self.table.shape[0]) if float(self.table[i].abs().max()) < STILL]
        kept = f"; token{'s' if len(still) > 1 else ''} {_spans(still)} turn{'' if len(still) > 1 else 's'} by " \
               "no angle (a prefix kept aside: a cls token, registers; or a token at position 0)" if still else ""
        return (f"it turns each token's pairs by angles of its own, the same for q and k, which no one position "
                f"times a frequency gives (a 2-D or axial RoPE: a token's row turns some pairs and its column others, "
                f"as EVA-02's, Pixtral's and Qwen2-VL's vision rotary do){kept}; read from your rotated tensors, "
                f"pairs {self.pairing}")


def angles_from(records: list[Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> Angles | None:
    """The angle table under which the last tensor above the queries the code hands its scores that is a rotation
    of the reference's unrotated `q` (`[.., n, d]`, in any layout, perhaps scaled), and the same for the keys `k`,
    are those rotated, where both share it (or the keys are left as they are: a mistake, rope.not_applied), some
    pair turns, and no 1-D position gives it; None otherwise. The keys
    are looked for above the scores' right operand, else above the pattern's partner: code that hands its rotated
    keys to the pattern and its values to the scores (`sdpa(q, v, k)`) still rotates them with the queries' table,
    and the swap is a mistake the catalog names (kv.swapped), never a RoPE the reference cannot be told of. So is
    code that swaps the projections before RoPE (Pixtral's `key_states = v_proj(x)` rotated as keys): its scores'
    keys are a rotation of the reference's unrotated values `v`, by the queries' table."""
    from attnscope.usertrace.flow import operands

    handed = operands(records)
    if handed is None or q.shape[-1] % 2 or q.shape[-2] != k.shape[-2] or q.shape[-2] < 2:
        return None
    for pairing in ("half-split", "interleaved"):
        turned = last_turned(records, handed[0], q.double(), pairing) or own_turn(records, handed[0], q.shape, pairing)
        # the keys' operand, else the values' (code that swaps k and v after RoPE), else the keys' operand turned
        # from the values (swapped before RoPE)
        tried = [(index, k) for index in handed[1:3]] + ([(handed[1], v)] if v is not None and v.shape == k.shape
                                                          else [])
        keys = next((found for index, unturned in tried
                     if (found := last_turned(records, index, unturned.double(), pairing)
                         or own_turn(records, index, unturned.shape, pairing)) is not None
                     and not _differs(found[1], turned)), None)
        if keys is None and turned is not None and _still(records, handed[1], k):
            keys = turned  # the keys left unrotated beside the queries' table: the catalog's rope.not_applied
        tables = [found[1] if found is not None else None for found in (turned, keys)]
        if tables[0] is None or tables[1] is None or float(tables[0].abs().max()) < STILL \
                or float(_wrapped(tables[0] - tables[1]).abs().max()) > ANGLE_TOL or one_position(tables[0]):
            continue
        return Angles(tables[0], pairing)
    return None


def _still(records: list[Any], index: int, k: torch.Tensor) -> bool:
    """Whether the scores' keys (record `index`) are the reference's unrotated keys `k` as they are: code that turns
    its queries by a table of its own and leaves its keys out (Qwen2-VL's vision rotary applied to q alone), whose
    table is then read from the queries, the keys' missing turn a mistake the catalog names."""
    import math as _math

    from attnscope.usertrace.align import REARRANGING, layouts

    want = k.double()
    record = records[index]
    while True:  # the operand itself, or what it only lays out anew (`k.transpose(-1, -2)`)
        tensor = record.tensor
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel() == _math.prod(k.shape):
            for layout in layouts(tuple(k.shape), tuple(tensor.shape), swaps=True):
                try:
                    held = layout.undo(tensor.detach(), tuple(k.shape)).double()
                except RuntimeError:
                    continue
                if torch.allclose(held, want, rtol=1e-4, atol=1e-5 * max(float(want.abs().max()), 1.0)):
                    return True
        if record.func not in REARRANGING or len(record.parents) != 1:
            return False
        record = records[record.parents[0]]


def _differs(table: torch.Tensor, turned: tuple[Any, torch.Tensor] | None) -> bool:
    """Whether an angle table read for the keys is not the queries' (`turned`, where read)."""
    return turned is not None and float(_wrapped(turned[1] - table).abs().max()) > ANGLE_TOL


def turned_by(source: torch.Tensor, mine: torch.Tensor, pairing: str) -> torch.Tensor | None:
    """The angle `[n, d/2]` each pair of `mine` is `source`'s turned by (`[.., n, d]`, float64), the same for every
    row of the leading axes, up to one gain; None where `mine` is no such rotation of `source`."""
    d = source.shape[-1]
    if d % 2 or source.shape != mine.shape or source.dim() < 2:
        return None
    a, b = _pair_indices(d, pairing)
    x = torch.complex(source[..., a], source[..., b])  # [.., n, d/2]
    u = torch.complex(mine[..., a], mine[..., b])
    angle = torch.angle((u * x.conj()).flatten(0, -3).sum(0))  # [n, d/2]
    turned = x * torch.polar(torch.ones_like(angle), angle)
    power = float((turned.abs() ** 2).sum())
    if power == 0.0:
        return None
    gain = float((u * turned.conj()).real.sum()) / power
    scale = float(u.abs().max())
    if gain <= 0 or float((u - gain * turned).abs().max()) > 1e-4 * max(scale, 1e-12):
        return None
    return angle


def last_turned(records: list[Any], index: int, source: torch.Tensor, pairing: str, width: int | None = None
                ) -> tuple[Any, torch.Tensor] | None:
    """The last record at or above record `index` whose tensor is `source` turned (turned_by), in any layout of its
    shape, with its angle table; None where none is. `width`: only the first `width` coordinates are read (a rotary
    fraction's part that turns)."""
    for record, mine in laid_above(records, index, tuple(source.shape)):
        table = turned_by(source[..., :width], mine[..., :width], pairing)
        if table is not None:
            return record, table
    return None


def laid_above(records: list[Any], index: int, shape: tuple[int, ...]) -> Iterator[tuple[Any, torch.Tensor]]:
    """Each record at or above record `index`, the last first, whose float tensor holds as many numbers as `shape`,
    laid out as `shape` (float64) in each layout its shape allows."""
    import math as _math

    from attnscope.usertrace.align import ancestors, layouts

    for i in sorted(ancestors(records[index], records) | {index}, reverse=True):
        tensor = records[i].tensor
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() \
                or tensor.numel() != _math.prod(shape):
            continue
        for layout in layouts(shape, tuple(tensor.shape)):
            try:
                yield records[i], layout.undo(tensor.detach(), shape).double()
            except RuntimeError:
                continue


OWN_TRIES = 8  # the tensors above an operand, and the tensors above each, that own_turn looks at (the nearest)


def own_turn(records: list[Any], index: int, shape: torch.Size, pairing: str) -> tuple[Any, torch.Tensor] | None:
    """The last record at or above record `index` that is an earlier tensor of the code's own turned (turned_by,
    some pair turning), each laid out as `shape` (`[.., n, d]`), with its angle table: the rotation the code applies,
    read from its own tensors before and after it, where what it rotates is not the reference's unrotated tensor (a
    mistake before RoPE: heads split without the transpose); None where none is. The nearest OWN_TRIES of each."""
    import math as _math

    from attnscope.usertrace.align import ancestors, layouts

    numel = _math.prod(shape)

    def held(i: int) -> bool:
        tensor = records[i].tensor
        return isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel() == numel

    above = [i for i in sorted(ancestors(records[index], records) | {index}, reverse=True) if held(i)]
    for i in above[:OWN_TRIES]:
        after = records[i].tensor.detach()
        sources = [j for j in sorted(ancestors(records[i], records), reverse=True)
                   if held(j) and records[j].tensor.shape == after.shape][:OWN_TRIES]
        for layout in layouts(tuple(shape), tuple(after.shape)):
            try:
                mine = layout.undo(after, tuple(shape)).double()
                befores = [layout.undo(records[j].tensor.detach(), tuple(shape)).double() for j in sources]
            except RuntimeError:
                continue
            for before in befores:
                table = turned_by(before, mine, pairing) if not torch.equal(before, mine) else None
                if table is not None and float(table.abs().max()) >= STILL:
                    return records[i], table
    return None


def one_position(table: torch.Tensor) -> bool:
    """Whether every pair turns by the same angle from each token to the next (a 1-D RoPE, from any position)."""
    steps = _wrapped(table[1:] - table[:-1])  # [n - 1, d/2]
    return bool((steps - steps[:1]).abs().max() <= ANGLE_TOL)


def _pair_indices(d: int, pairing: str) -> tuple[torch.Tensor, torch.Tensor]:
    if pairing == "half-split":
        a = torch.arange(d // 2)
        return a, a + d // 2
    a = torch.arange(0, d, 2)
    return a, a + 1


def scaled_base(table: Table, width: int) -> tuple[float, float] | None:
    """(base, factor) where the table is a base's own frequencies over one factor, base^(−2i/width) / f for every
    pair (linear RoPE scaling), both solved from the table (log f_i = −(2i/width)·log base − log f, least squares
    weighted by each frequency), the base given with the fewest significant digits that keep the factor one for
    every pair (linear_factor, which also says f); None where no base and factor give the table, or f is 1."""
    freqs = torch.tensor(table.freqs, dtype=torch.float64)
    exponent = 2 * torch.arange(len(table.freqs), dtype=torch.float64) / width
    if len(table.freqs) < 3 or not bool((freqs > 0).all()):
        return None
    w, y = freqs, freqs.log()
    x_mean, y_mean = float((w * exponent).sum() / w.sum()), float((w * y).sum() / w.sum())
    slope = float((w * (exponent - x_mean) * (y - y_mean)).sum() / (w * (exponent - x_mean) ** 2).sum())
    if not 0 < -slope < 700:
        return None
    solved = math.exp(-slope)
    for base in [float(f"{solved:.{digits}g}") for digits in range(1, 9)] + [solved]:
        factor = linear_factor(table, base, width)
        if factor is not None:
            return base, factor
    return None


def linear_factor(table: Table, base: float, width: int) -> float | None:
    """The factor f where the table is `base`'s own over f, every pair alike (linear RoPE scaling: positions t / f,
    transformers' `rope_scaling={"type": "linear", "factor": f}`); None where the pairs' ratios differ (another
    base, another schedule) or f is 1."""
    ratios = [base ** (-2 * i / width) / f for i, f in enumerate(table.freqs) if f != 0.0]
    if len(ratios) != len(table.freqs) or not all(math.isclose(r, ratios[0], rel_tol=1e-3) for r in ratios):
        return None
    factor = sum(ratios) / len(ratios)
    nice = round(factor, 2)
    factor = nice if math.isclose(nice, factor, rel_tol=1e-4) else factor
    return None if math.isclose(factor, 1.0, rel_tol=1e-4) else factor


def base_from(angles: torch.Tensor, positions: torch.Tensor, over: int) -> float | None:
    """The base whose frequencies base^(−2i/over) turn pair i by `angles[t, i]` at `positions[t]` (`[n, pairs]`
    radians, from turned_by), solved from them: each pair's frequency its mean turn from one position to the next (or
    its angle over the position, where one position is read), log f_i = −(2i/over)·log base by least squares over
    the pairs past the first (each weighted by its frequency: an angle's error is absolute); given with the fewest
    significant digits that fit the angles as well as the solved base does. None where the angles are no base's
    (a table of the code's own, positions scaled), by more than ANGLE_TOL."""
    a, p = angles.double(), positions.double()
    if a.dim() != 2 or a.shape[0] != p.shape[0] or a.shape[1] < 2:
        return None
    if a.shape[0] > 1:
        steps = p[1:] - p[:-1]
        if bool((steps == 0).any()):
            return None
        freqs = (_wrapped(a[1:] - a[:-1]) / steps[:, None]).mean(0).abs()
    elif float(p[0]) != 0.0:
        freqs = (a[0] / p[0]).abs()
    else:
        return None
    exponent = 2 * torch.arange(a.shape[1], dtype=torch.float64) / over  # [pairs]
    used = (exponent > 0) & (freqs > STILL)
    if not bool(used.any()):
        return None
    w, x, y = freqs[used], exponent[used], freqs[used].log()
    log_base = -float((w * x * y).sum() / (w * x * x).sum())
    if not 0 < log_base < 700:
        return None
    sign = 1.0 if float((a * p[:, None]).sum()) >= 0 else -1.0

    def miss(base: float) -> float:
        return float(_wrapped(a - sign * p[:, None] * base ** -exponent[None]).abs().max())

    solved = math.exp(log_base)
    fit = miss(solved)
    if fit > ANGLE_TOL:
        return None
    return next((nice for digits in range(1, 9) if miss(nice := float(f"{solved:.{digits}g}")) <= 2 * fit + 1e-9),
                solved)


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
