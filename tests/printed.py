"""Printed output compared as a reader compares it: every word and the layout exactly, and the numbers a CPU
rounds differently (a float32 max |diff| of 8.9e-08 on one machine, 1.2e-07 on another) within a tolerance.

Used by the tests that check the output quoted in the docs against the real output.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_NUMBER = re.compile(r"[-+]?\d+\.\d+e[-+]\d+")  # scientific notation: how max |diff| and tolerances are printed


def same_line(shown: str, real: str, atol: float = 1e-6, rtol: float = 0.01) -> bool:
    """`real` reads as `shown`: the same text around the numbers, each number within atol + rtol·|shown|."""
    if _NUMBER.sub("#", shown.rstrip()) != _NUMBER.sub("#", real.rstrip()):
        return False
    pairs = zip(map(float, _NUMBER.findall(shown)), map(float, _NUMBER.findall(real)), strict=True)
    return all(abs(a - b) <= atol + rtol * abs(a) for a, b in pairs)


def missing_lines(shown: Iterable[str], real: Iterable[str]) -> list[str]:
    """The non-blank lines of `shown` that no line of `real` reads as (same_line)."""
    real = [line.rstrip() for line in real]
    return [line for line in shown if line.strip() and not any(same_line(line, r) for r in real)]
