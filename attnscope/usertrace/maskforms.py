"""The mask in the code's other forms: where the code, given the mask in the form its ops were read as, returns
values that are not finite although the mask leaves every query a key (HF Pix2Struct's `1 - mask` position bias,
then `masked_fill(bias == 1, finfo.min)`, handed 0/-inf), the forms a mask is written in (0/1 numbers, a boolean,
a bias to add) are tried in turn, and the first whose run is finite and whose pattern keeps to the mask is kept.
runs/trace_mask.py tries them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from attnscope.usertrace.record import Record

# the forms tried, in order: 0/1 numbers and booleans (either polarity), then biases to add or subtract
FORMS = ("float01", "attend", "float10", "masked", "additive_min", "additive", "subtracted")
# a mask's values: beyond FAR (-1e9, -1e30, finfo.min, -inf: a score added to them is lost), or within SPREAD (a
# score added) of one of MASK_VALUES (BERT's -10000, float16's finfo.min)
FAR = -1e8
MASK_VALUES = (-1e4, -65504.0)
SPREAD = 1e3



def in_turn(first: str) -> tuple[str, ...]:
    """The conventions to try a mask in: `first` (the one read from the code), then the others of FORMS."""
    return (first, *(k for k in FORMS if k != first))

def _pattern_from_mask(records: list[Record], label: str) -> tuple[Record | None, bool]:
    """The code's first pattern (a softmax, a kernel's recomputed attention), and whether it is computed from the
    mask parameter `label` through any ops (a position bias the mask is added to, then `1 - bias`): the mask is
    applied before the softmax."""
    from attnscope.usertrace.masking import is_pattern

    derived: set[int] = set()
    for record in records:
        texts = [value for kind, value in record.args if kind == "text"] + [
            value[1][1] for kind, value in record.args if kind == "kw" and value[1][0] == "text"]
        if label in texts or derived & set(record.parents):
            derived.add(record.index)
        if is_pattern(record):
            return record, record.index in derived
    return None, False


def drowned(records: list[Record], label: str, every: bool = False, rows: torch.Tensor | None = None) -> bool:
    """Whether the scores the code's first pattern is computed from, made from the mask, hold a query whose every
    key is masked (very negative or NaN): the mask, as it was written, masked the keys it allows too (0 / -inf
    turned into `(1 - bias) * finfo.min`: finfo.min on every kept key, -inf on the padded). `every`: whether every
    query is (a key padding applied on the queries drowns the padded queries alone). `rows` [n_batch, n_Q]: queries
    the mask leaves no key (maskrows.keyless), drowned by the mask itself and not read."""
    import torch

    from attnscope.usertrace.align import VERY_NEGATIVE
    from attnscope.usertrace.maskrows import rows_kept

    pattern, derived = _pattern_from_mask(records, label)
    if pattern is None or not derived or not pattern.parents:
        return False
    by_index = {r.index: r for r in records}
    scores = by_index.get(pattern.parents[0])
    if scores is None or not scores.tensor.is_floating_point() or scores.tensor.dim() < 2:
        return False
    low = masked_cells(scores.tensor.detach(), VERY_NEGATIVE)
    full = low.all(-1)  # [.., n_Q]
    kept = rows_kept(full, rows)
    if not every:
        return bool(kept.any())
    read = rows_kept(torch.ones_like(full), rows)  # the queries the mask leaves a key
    return bool(read.any()) and bool(kept[read].all())


def masked_cells(scores: torch.Tensor, very_negative: float) -> torch.Tensor:
    """The cells of `scores` at a mask's value: NaN, -inf, beyond any score (-1e9, finfo.min: a score added to them
    is lost), near a value masks are written with (BERT's -10000 + score, float16's finfo.min), or one value the code
    filled every very negative cell of the row with (`masked_fill(mask, -1e5)`). Scores that are large alone (a
    model's own offset of -1e5 + score, a huge scale) differ from cell to cell and hold none of these."""
    import torch

    at = torch.isnan(scores) | (scores <= FAR)
    for value in MASK_VALUES:
        at |= (scores - value).abs() <= SPREAD
    low = (scores <= very_negative) & torch.isfinite(scores)
    hi = scores.masked_fill(~low, float("-inf")).amax(-1, keepdim=True)
    lo = scores.masked_fill(~low, float("inf")).amin(-1, keepdim=True)
    return at | (low & (hi == lo))


def keeps_to(records: list[Record], allowed: torch.Tensor, sizes: dict[str, int]) -> bool:
    """Whether a run's pattern gives no weight to a key the mask `allowed` forbids (masking.holds; key padding
    [n_batch, n_K] laid over the queries): a form added to the scores as numbers (0/1 where the code wants 0 / -inf)
    masks nothing and is never kept."""
    import torch

    from attnscope.usertrace import masking
    from attnscope.usertrace.maskrows import laid

    grid = laid(allowed, sizes) if allowed.dtype == torch.bool else None  # key padding [n_batch, n_K] laid out too
    return bool(masking.holds(records, grid if grid is not None else allowed, sizes))
