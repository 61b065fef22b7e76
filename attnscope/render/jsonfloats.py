"""A float32 (or float16, bfloat16) tensor's values as one JSON array, written by numpy in whole-array steps.

json's C encoder writes each number through Python's float repr: 1.2 s for the 2.7M attention weights of a 16-layer
`--all-layers --json` run, most of that run's cost beyond the grid. Here the numbers of a chunk are formatted
together: each is cut from one row of fixed columns (a sign, "0.000", nine digits each with a point after it, a
"0", an exponent), keeping the columns its text needs; dropping the others moves the kept ones together.

Each number is written with the fewest of 6, 7, 8 or 9 significant digits that give the same float32 back (nine
always do: FLT_DECIMAL_DIG), a shorter decimal kept only where it lies within 0.49 of the gap below the value (the
smaller gap), so the float64 arithmetic that finds the digits can never pick one that reads back as a neighbour. A
reader that parses the text as float64 and rounds to float32 gets the tensor's values bit for bit. The layout is
Python's repr's (`0.25`, `1.0`, `0.0001`, `1e-05`, `-3.5e+20`) except that positional stops at 1e9 (`1.5e+09`, where
repr writes `1500000000.0`). Float64 tensors keep json's own writer, whose repr is exact for them.
"""

from __future__ import annotations

import os

import numpy as np

CHUNK = 1 << 15  # numbers formatted at once: the character grids stay about a MiB
_TRIED = (6, 7, 8)  # fewer significant digits tried before nine
_POWERS = np.array([float(f"1e{k}") for k in range(-80, 81)])  # 10 ** k, correctly rounded, at k + 80

# The columns every number's text is cut from: a sign, "0." and three zeros (positional below 1), nine digits each
# followed by a point, a "0" (the one of 1.0), then "e", the exponent's sign and two digits (a float32's decimal
# exponent is -45 to 38). Held as rows, one a column, so that each step runs over contiguous memory.
_TEMPLATE = np.frombuffer(b"-0.000" + b"0." * 9 + b"0e+00", dtype=np.uint8)
_SIGN, _LEAD, _DIGITS, _TAIL, _E = 0, 1, 6, 24, 25
_TABLES: tuple[np.ndarray, np.ndarray] | None = None


def _decimal(x: np.ndarray, exp: np.ndarray, digits: int) -> tuple[np.ndarray, np.ndarray]:
    """x (positive) rounded to `digits` significant digits: the integer of those digits and the decimal exponent
    of the first, `exp` a guess within one of it."""
    exp = exp.copy()
    m = np.rint(x * _POWERS[digits - 1 - exp + 80])
    for _ in range(2):  # log10's guess off by one near a power of ten (or the rounding up to one)
        high, low = m >= _POWERS[digits + 80], m < _POWERS[digits - 1 + 80]
        fix = high | low
        if fix.any():
            exp += high
            exp -= low
            m[fix] = np.rint(x[fix] * _POWERS[digits - 1 - exp[fix] + 80])
    return m, exp


def _shortest(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The nine significant digits (an integer, zeros after the last that counts) and the decimal exponent of the
    first, of each positive float32 value in `x` (float64): the fewest of _TRIED digits where they read back. A
    shorter decimal is cut from the nine digits (which may round twice and miss one that would do: the text is
    then a digit longer, never wrong), and kept by its distance from x itself."""
    exp = np.floor(np.log10(x)).astype(np.int64)
    m, exp = _decimal(x, exp, 9)
    unit = _POWERS[exp - 8 + 80]  # the ninth digit's worth
    single = x.astype(np.float32)
    within = 0.49 * (single - np.nextafter(single, np.float32(0))).astype(np.float64)  # the gap below: the smaller
    best = m.copy()
    for digits in reversed(_TRIED):  # the fewest digits that read back as the same float32 win
        step = _POWERS[9 - digits + 80]
        short = np.rint(m / step) * step
        ok = np.abs(short * unit - x) < within
        best += ok * (short - best)  # arithmetic: np.where, branching on a condition with no pattern, costs more
    carry = best >= 1e9  # rounded up to the next power of ten
    return (best / (1 + 9 * carry)).astype(np.int64), exp + carry


def _digit_tables() -> tuple[np.ndarray, np.ndarray]:
    """The ASCII digits of 0..99999 (`[5, 100000]`, the first digit's row first) and of the two digits of 0..99,
    made once a process."""
    global _TABLES
    if _TABLES is None:
        five = ((np.arange(100000)[None, :] // 10 ** np.arange(4, -1, -1)[:, None]) % 10 + ord("0"))
        _TABLES = five.astype(np.uint8), five[3:, :100].astype(np.uint8)
    return _TABLES


def _texts(values: np.ndarray, grid: np.ndarray) -> None:
    """Each value's text written into `grid` (`[len(_TEMPLATE), N]`) as the columns of ASCII codes it keeps, 0 in
    those it drops: positional where the decimal exponent is -4 to 8 (`0.0001`, `0.25`, `123456789.0`), else with
    an exponent of two digits (`1e-05`, `1.5e+09`)."""
    x = np.abs(values)
    zero = x == 0
    m, exp = _shortest(np.where(zero, 1.0, x))
    m[zero], exp[zero] = 0, 0
    five, two = _digit_tables()
    grid[:] = _TEMPLATE[:, None]
    high, low = m // 10000, m % 10000
    for k in range(9):
        grid[_DIGITS + 2 * k] = five[k].take(high) if k < 5 else five[k - 4].take(low)
    digits = grid[_DIGITS:_TAIL:2]  # [9, N]
    place = np.arange(1, 10)[:, None]
    count = np.maximum.reduce((digits != ord("0")) * place, axis=0).clip(1)  # the digits up to the last not 0
    power = np.abs(exp)
    below = exp < 0
    grid[_E + 1] += below.astype(np.uint8) * np.uint8(ord("-") - ord("+"))
    grid[_E + 2], grid[_E + 3] = two[0].take(power), two[1].take(power)
    plain = (exp >= -4) & (exp <= 8)
    keep = np.empty(grid.shape, dtype=bool)
    keep[_SIGN] = np.signbit(values)
    keep[_LEAD] = keep[_LEAD + 1] = plain & below
    keep[_LEAD + 2:_DIGITS] = plain & (np.arange(3)[:, None] < -exp - 1)
    j = place - 1  # digit j, and the point after it
    keep[_DIGITS:_TAIL:2] = (j < count) | (plain & (j <= exp))
    keep[_DIGITS + 1:_TAIL:2] = (plain & (j == exp)) | (~plain & (j == 0) & (count > 1))
    keep[_TAIL] = plain & ~below & (count <= exp + 1)
    keep[_E:] = ~plain
    grid *= keep  # the columns dropped: 0, which the join removes (a masked assignment costs eighty times this)


def float_text(values: np.ndarray) -> str:
    """`values` (float64 holding float32-exact values, at least one axis, none empty, all finite) as the JSON text
    of its nested lists, separated as json.dumps separates them (`[[0.5, 0.25], [1.0, 0.0]]`). Taken in chunks of
    CHUNK numbers, so the grids stay small whatever the tensor's size, on up to four threads where there are several
    (numpy lets go of the GIL in its loops: two cores take 0.4 s where one takes 0.65 for 2.7M numbers)."""
    shape = values.shape
    flat = values.reshape(-1)
    n, depth = flat.size, len(shape)
    spans = [int(np.prod(shape[k:])) for k in range(depth)]  # numbers under one list of each depth
    width = len(_TEMPLATE)

    def chunk_text(start: int) -> bytes:
        chunk = flat[start:start + CHUNK]
        size = chunk.size
        rows = np.empty((2 * depth + 2 + width, size), dtype=np.uint8)  # one a column of the text
        rows[:depth] = rows[depth + width:2 * depth + width] = 0
        for k, span in enumerate(spans):  # "[" before a number for each list it starts, "]" after for each it ends
            rows[k, -start % span::span] = ord("[")
            rows[depth + width + k, (span - 1 - start) % span::span] = ord("]")
        _texts(chunk, rows[depth:depth + width])
        rows[-2:] = np.array([[ord(",")], [ord(" ")]], dtype=np.uint8)
        if start + size == n:
            rows[-2:, -1] = 0
        return rows.T.tobytes().translate(None, b"\0")

    starts = range(0, n, CHUNK)
    workers = min(4, os.cpu_count() or 1, len(starts))
    if workers < 2:
        return b"".join(map(chunk_text, starts)).decode("ascii")
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        return b"".join(pool.map(chunk_text, starts)).decode("ascii")
