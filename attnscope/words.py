"""Counts in words: "1 key", "3 keys", "1 query", "2,048 queries". Every message built with a count says it
through `counted`, so no line reads "the last 1 keys padded"."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and `noun`, the plural where `n` is not 1 (`plural`, else a y after a consonant -> "ies", else
    "s"); thousands grouped (`2,048 tokens`)."""
    if n == 1:
        return f"1 {noun}"
    if plural is None:
        plural = noun[:-1] + "ies" if noun.endswith("y") and noun[-2:-1] not in "aeiou" else noun + "s"
    return f"{n:,} {plural}"


def run_of(noun: str, indices: list[int]) -> str:
    """Positions in words, `noun` the plural ("tokens", "keys"): "tokens 0, 5, … 15 (5 apart)" for an even step
    wider than 1 over more than two, "tokens 3 to 7" for a run, else the first six listed ("tokens 0, 2, 3, …")."""
    step = {b - a for a, b in zip(indices[:-1], indices[1:], strict=True)}
    if len(step) == 1 and len(indices) > 2 and next(iter(step)) > 1:
        return f"{noun} {indices[0]}, {indices[1]}, … {indices[-1]} ({step.pop()} apart)"
    if step == {1}:
        return f"{noun} {indices[0]} to {indices[-1]}"
    return f"{noun} {', '.join(str(i) for i in indices[:6])}{', …' if len(indices) > 6 else ''}"
