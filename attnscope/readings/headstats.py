"""What a head does, in numbers: statistics of one attention pattern and a one-word kind.

For a pattern A `[n_Q, n_K]` (rows = queries, each summing to 1 over the keys it may see; a row of zeros,
a query that may see no key, is left out), with query i at position p = i + offset:

- entropy: the mean over query rows of `-Σ_j A[i, j] log2 A[i, j]`, in bits (0: all on one key;
  log2(n): uniform over n keys);
- first: the mean of `A[i, 0]`, the mass on the first token (the "attention sink");
- previous: the mean over rows with p ≥ 1 of `A[i, p − 1]`, the mass on the previous token;
- self: the mean over rows with p < n_K of `A[i, p]`, the mass on the query's own position;
- distance: the mean over rows of `Σ_j A[i, j] |p − j|`, the mean attended distance in positions;
- spread: the mean over rows that may see at least two keys of the entropy divided by log2 of how many
  keys the row may see (1: uniform over what it may see): p + 1 keys when the pattern is causal (nothing
  above the diagonal), n_K otherwise. A key is not "unseen" because its weight underflowed to 0.

The kind, from these thresholds (the first that holds):
`first-token` if first ≥ 0.5, `previous-token` if previous ≥ 0.5, `self` if self ≥ 0.5 (the largest of
the three wins when several hold), `broad` if spread ≥ 0.85, `local` if distance ≤ 2, else `mixed`.
(0.85 rather than 0.9: on all-MiniLM-L6-v2 the heads of layer 0 that look even across the sentence reach
0.85 to 0.90, and a spread of 0.85 is still about n^0.85 keys alike, 9 of 13; docs/heads.md.)

`LayerHeads` is every head of one layer (one batch element) with its statistics and kind, as `--all-heads`
shows them and a notebook draws them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

KINDS = ("first-token", "previous-token", "self", "broad", "local", "mixed")
DOMINANT = 0.5  # first, previous or self at least this: the head's kind is that position
BROAD = 0.85  # spread at least this: close to uniform over what each query may see
LOCAL = 2.0  # mean attended distance at most this many positions


@dataclass(frozen=True)
class HeadStats:
    entropy: float
    first: float
    previous: float
    self: float
    distance: float
    spread: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def head_stats(pattern: Tensor, offset: int = 0) -> HeadStats:
    """The statistics of one `[n_Q, n_K]` pattern (computed in float64)."""
    import torch

    A = pattern.detach().to(torch.float64)
    n_Q, n_K = A.shape
    rows = A.sum(dim=-1) > 0  # queries that may see some key
    position = torch.arange(n_Q, dtype=torch.float64) + offset  # [n_Q]
    logs = torch.where(A > 0, torch.log2(A.clamp_min(1e-300)), 0.0)
    entropy_rows = -(A * logs).sum(dim=-1)  # [n_Q], bits
    keys = torch.arange(n_K, dtype=torch.float64)
    distance_rows = (A * (position[:, None] - keys[None, :]).abs()).sum(dim=-1)
    causal = bool((A.triu(diagonal=offset + 1) == 0).all())
    visible = (position + 1).clamp(max=n_K) if causal else torch.full((n_Q,), float(n_K), dtype=torch.float64)
    spread_rows = entropy_rows / torch.log2(visible.clamp_min(2))
    p = position.long()
    has_prev = rows & (p >= 1) & (p - 1 < n_K)
    has_self = rows & (p < n_K)
    index = torch.arange(n_Q)
    prev = A[index[has_prev], (p - 1)[has_prev]]
    own = A[index[has_self], p[has_self]]
    wide = rows & (visible >= 2)
    return HeadStats(
        entropy=_mean(entropy_rows[rows]), first=_mean(A[rows, 0]), previous=_mean(prev), self=_mean(own),
        distance=_mean(distance_rows[rows]), spread=_mean(spread_rows[wide]) if bool(wide.any()) else 0.0)


def _mean(values: Tensor) -> float:
    return float(values.mean()) if values.numel() else 0.0


def kind(stats: HeadStats) -> str:
    """One word for what the head does (thresholds in this module's docstring and docs/heads.md)."""
    positional = {"first-token": stats.first, "previous-token": stats.previous, "self": stats.self}
    name, mass = max(positional.items(), key=lambda item: item[1])
    if mass >= DOMINANT:
        return name
    if stats.spread >= BROAD:
        return "broad"
    if stats.distance <= LOCAL:
        return "local"
    return "mixed"


def describe(pattern: Tensor, offset: int = 0) -> tuple[str, dict[str, float]]:
    """A head's kind and statistics, as the explorer page shows them (views/sources.py's `Describe`)."""
    stats = head_stats(pattern, offset)
    return kind(stats), stats.as_dict()


def describe_heads(attention: Tensor, offset: int = 0) -> list[dict[str, Any]]:
    """Every head of one batch element, `[n_head, n_Q, n_K]`: `{"head", "stats", "kind"}` per head."""
    heads = []
    for h in range(attention.shape[0]):
        stats = head_stats(attention[h], offset)
        heads.append({"head": h, "stats": stats.as_dict(), "kind": kind(stats)})
    return heads


@dataclass
class LayerHeads:
    """Every head of one layer, for one batch element: the patterns `[n_head, n_Q, n_K]`, their axis labels,
    where query 0 sits (`offset`: query i is at position i + offset), and each head's `{"head", "stats",
    "kind"}` (`describe_heads`). `batch` is the batch element (None for a model's single sequence)."""

    title: str
    attention: Tensor
    row_labels: list[str]
    col_labels: list[str]
    offset: int = 0
    batch: int | None = None
    heads: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, attention: Tensor, title: str, row_labels: list[str] | None = None,
           col_labels: list[str] | None = None, offset: int = 0, batch: int | None = None) -> LayerHeads:
        n_Q, n_K = attention.shape[-2:]
        return cls(title, attention, row_labels or [f"q{i}" for i in range(n_Q)],
                   col_labels or [f"k{j}" for j in range(n_K)], offset, batch, describe_heads(attention, offset))

    def _repr_html_(self) -> str:
        """Jupyter draws every head as a small heatmap with its kind, and the table of statistics (views/embed.py)."""
        from attnscope.views.embed import heads_view

        return heads_view(self)
