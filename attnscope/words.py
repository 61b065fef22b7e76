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
