"""One combined mask as a grid (True = may attend), with its alignment named and what it was made of.

`attnscope mask` shows it on its own, `sdpa --show-mask` and `mha --show-mask` above their tables;
translations.py says the same mask in other libraries' words.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from attnscope import masks
from attnscope.spec import in_words
from attnscope.words import counted

if TYPE_CHECKING:
    import torch

    from attnscope.spec import AttentionSpec


@dataclass
class MaskView:
    n_Q: int
    n_K: int
    grid: list[list[bool]]  # [n_Q][n_K], True = may attend
    alignment: str  # "upper-left", "lower-right" or "none"
    offset: int  # query i sits at position i + offset
    parts: list[str]  # what was combined, in words
    translations: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """The alignment's rule; for lower-right, what the last query sees, read from the grid itself (a window,
        padding or a mask file take keys from it: `--cache 4 --window 3` shows q3 seeing keys 5-7, not all)."""
        shift = f"{'−' if self.offset < 0 else '+'} {abs(self.offset)}"
        where = {"upper-left": "upper-left: query i sees keys j ≤ i",
                 "lower-right": f"lower-right: query i sees keys j ≤ i {shift}; the last query sees "
                                f"{seen_keys(self.grid[-1]) if self.grid else 'no key'}",
                 "none": "none (not causal): a query sees every key its mask allows"}
        return where[self.alignment]


def seen_keys(row: list[bool]) -> str:
    """A query's row of the grid in words: "all keys", "keys 5-7", "key 7", "keys 0-1 and 5-7", "no key"."""
    if all(row):
        return "all keys"
    runs: list[list[int]] = []  # [first, last] of each run of seen keys
    for j, seen in enumerate(row):
        if seen and runs and runs[-1][1] == j - 1:
            runs[-1][1] = j
        elif seen:
            runs.append([j, j])
    if not runs:
        return "no key"
    words = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    many = len(runs) > 1 or runs[0][0] != runs[0][1]
    return ("keys " if many else "key ") + (", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1
                                             else words[0])


def view(n_Q: int, n_K: int, spec: AttentionSpec, *, pad: int = 0, user_mask: torch.Tensor | None = None) -> MaskView:
    """The mask sdpa and mha build for `spec`, padding and a mask file (masks.py's rules), for one [n_Q, n_K]
    pattern."""
    import torch

    align = spec.align
    allowed, _ = masks.structural(spec, n_Q, n_K)
    given = []
    if pad:
        allowed = masks.combine(allowed, masks.key_padding_mask(n_K, pad))
        given.append(f"the last {counted(pad, 'key')} padded")
    user_kind = None
    if user_mask is not None:
        if user_mask.dim() > 2:
            user_mask = user_mask.reshape(-1, *user_mask.shape[-2:])[0]  # [.., n_Q, n_K] -> the first [n_Q, n_K]
            given.append("the mask file (its first [n_Q, n_K] slice)")
        else:
            given.append("the mask file")
        masks.check_broadcast(user_mask, (n_Q, n_K))
        user = masks.normalize(user_mask)
        user_kind = "float" if user.is_floating_point() else "bool"
        seen = ~torch.isneginf(user) if user.is_floating_point() else user
        allowed = masks.combine(allowed, seen)
    grid = (allowed if allowed is not None else torch.ones(n_Q, n_K, dtype=torch.bool)).expand(n_Q, n_K)
    result = MaskView(n_Q, n_K, grid.tolist(), align or "none", spec.offset(n_Q, n_K),
                      in_words(spec, "mask", given=given))
    from attnscope.readings.translations import translate

    result.translations = translate(n_Q, n_K, spec, pad, user_kind)
    if spec.sinks:
        from attnscope.readings.sink_translations import with_sinks

        result.translations = with_sinks(result.translations, n_Q, n_K, spec, pad, user_kind)
    return result
