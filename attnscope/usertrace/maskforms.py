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


def drowned(records: list[Record], label: str, every: bool = False) -> bool:
    """Whether the scores the code's first pattern is computed from, made from the mask, hold a query whose every
    key is masked (very negative or NaN): the mask, as it was written, masked the keys it allows too (0 / -inf
    turned into `(1 - bias) * finfo.min`: finfo.min on every kept key, -inf on the padded). `every`: whether every
    query is (a key padding applied on the queries drowns the padded queries alone)."""
    import torch

    from attnscope.usertrace.align import VERY_NEGATIVE

    pattern, derived = _pattern_from_mask(records, label)
    if pattern is None or not derived or not pattern.parents:
        return False
    by_index = {r.index: r for r in records}
    scores = by_index.get(pattern.parents[0])
    if scores is None or not scores.tensor.is_floating_point() or scores.tensor.dim() < 2:
        return False
    low = torch.isnan(scores.tensor) | (scores.tensor <= VERY_NEGATIVE)
    rows = low.all(-1)
    return bool(rows.all() if every else rows.any())


def keeps_to(records: list[Record], allowed: torch.Tensor, sizes: dict[str, int]) -> bool:
    """Whether a run's pattern gives no weight to a key the mask `allowed` forbids (masking.holds): a form added to
    the scores as numbers (0/1 where the code wants 0 / -inf) masks nothing and is never kept."""
    from attnscope.usertrace import masking

    return bool(masking.holds(records, allowed, sizes))
