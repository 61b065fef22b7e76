"""Statistics and previews of a tensor of any size, in float64 pieces that never copy the whole tensor."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

STATS_CHUNK = 1 << 20  # elements: float64 copies of this size at most, whatever the tensor's size


def _chunks(tensor: torch.Tensor, limit: int = STATS_CHUNK) -> Iterator[torch.Tensor]:
    """Flat pieces of at most `limit` elements; only a piece is ever copied (a permuted view stays a view)."""
    if tensor.numel() <= limit:
        yield tensor.reshape(-1)  # [numel]
    elif tensor.dim() == 1:
        yield from tensor.split(limit)
    else:
        rows = max(1, limit // tensor[0].numel())  # whole rows per piece
        for block in tensor.split(rows, dim=0):
            if block.numel() <= limit:
                yield block.reshape(-1)  # [numel]
            else:  # one row is larger than a piece
                yield from _chunks(block[0], limit)


def tensor_stats(tensor: torch.Tensor) -> dict[str, float | int] | None:
    """min, max, mean, std (unbiased) over the finite values, and how many are NaN or Inf; None for a meta
    tensor. Computed chunk by chunk in float64 (Chan's merge of means and squared deviations), so a
    statistic never needs more than a small fraction of the tensor's memory."""
    import torch

    if tensor.device.type == "meta" or tensor.numel() == 0:
        return None
    count, mean, m2 = 0, 0.0, 0.0
    low, high = float("inf"), float("-inf")
    nan = inf = 0
    for chunk in _chunks(tensor.detach()):
        values = chunk.to(torch.float64)
        finite_mask = torch.isfinite(values)
        nan += int(torch.isnan(values).sum())
        inf += int(torch.isinf(values).sum())
        finite = values[finite_mask]
        n = finite.numel()
        if not n:
            continue
        chunk_mean = float(finite.mean())
        chunk_m2 = float(((finite - chunk_mean) ** 2).sum())
        delta, total = chunk_mean - mean, count + n
        mean += delta * n / total
        m2 += chunk_m2 + delta * delta * count * n / total
        count = total
        low, high = min(low, float(finite.min())), max(high, float(finite.max()))
    stats: dict[str, float | int] = {"nan": nan, "inf": inf}
    if count:
        stats.update(min=low, max=high, mean=mean, std=(m2 / (count - 1)) ** 0.5 if count > 1 else 0.0)
    else:
        stats.update(min=float("nan"), max=float("nan"), mean=float("nan"), std=float("nan"))
    return stats


def preview(tensor: torch.Tensor, limit: int, width: int = 96) -> str:
    """The numbers of a small tensor, or the corners of a large one, four significant digits, each line at most
    `width` columns (torch's own `linewidth`, which counts the "tensor(" indent too)."""
    import torch

    if tensor.device.type == "meta":
        return "(meta tensor: shape only, no values)"
    torch.set_printoptions(precision=4, threshold=limit, edgeitems=3, linewidth=width, sci_mode=False)
    try:
        return str(tensor.detach())
    finally:
        torch.set_printoptions(profile="default")
