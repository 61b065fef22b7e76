"""A mask the code puts axes on itself before it meets the scores (Transformer-XL's `attn_mask[:, :, :, None]` on
time-first scores `[n_Q, n_K, n_batch, n_head]`, a `[n_Q, n_K, 1]` mask given): where the code raised there, the
mask is laid out as the scores it met (masking.laid_like), less the axes of 1 the code adds, so that what it makes
of the mask is laid like its scores."""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from attnscope.usertrace.record import Failure, Record


def met(failure: Failure | None, records: list[Record], label: str, given: list[int]
        ) -> tuple[list[int], tuple[int, ...]] | None:
    """(the shape of the scores the mask met in the op the code raised in, the axes of 1 the code put on the mask
    before it: their places in what met the scores), where that op reads a tensor made from the mask parameter
    `label` with axes of 1 added and nothing else changed; None otherwise."""
    from attnscope.usertrace.paramuse import derived

    if failure is None:
        return None
    made = derived(records, label)
    shapes = [list(records[v].tensor.shape) for kind, v in failure.args if kind == "rec" and v in made]
    if not shapes:
        return None
    mask = shapes[0]
    added = _added(given, mask)
    others = [list(s) for s in failure.shapes if list(s) != mask and len(s) >= 2]
    if added is None or not added or not others:
        return None
    return max(others, key=lambda shape: math.prod(shape)), added


def _added(given: list[int], mask: list[int]) -> tuple[int, ...] | None:
    """The places of the axes of 1 that make `given` into `mask`, the last such places where several would; None
    where `mask` is not `given` with axes of 1 put in."""
    extra = len(mask) - len(given)
    if extra <= 0:
        return None
    for places in sorted(itertools.combinations(range(len(mask)), extra), reverse=True):
        if all(mask[i] == 1 for i in places) and [m for i, m in enumerate(mask) if i not in places] == given:
            return places
    return None


def laid(allowed: torch.Tensor, found: tuple[list[int], tuple[int, ...]], sizes: dict[str, int], col: bool = False
         ) -> tuple[torch.Tensor, str, None] | None:
    """The mask (True = may attend) laid as the scores it met, less the axes the code adds itself (`met`): with its
    words; None where those axes would hold the queries, the keys or the batch."""
    from attnscope.usertrace.masking import laid_like

    scores, added = found
    form = laid_like(allowed, scores, sizes, col)
    if form is None or any(form[0].shape[i] != 1 for i in added if i < form[0].dim()):
        return None
    kept = [i for i in range(form[0].dim()) if i not in added]
    words = form[1].split("]", 1)[0].lstrip("[").split(", ")
    shape = [int(form[0].shape[i]) for i in kept]
    return (form[0].reshape(shape), f"[{', '.join(words[i] for i in kept)}], laid as the scores it meets ({scores}) "
            "once your code adds its own axes", None)
