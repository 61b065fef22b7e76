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
  above the diagonal), n_K otherwise. A key is not "unseen" because its weight underflowed to 0;
- induction (with the tokens known): the mean, over rows whose token occurred earlier, of the weight on the
  tokens that followed its earlier occurrences, `Σ A[i, j + 1]` over j + 1 < p with `token[j] = token[p]`
  (Olsson et al.'s induction heads: "... A B ... A" attends to B); 0 when no token repeats. A VLM's image tokens
  (labelled `img(r,c)`: one placeholder id) are no repeat and follow none (`LayerHeads.of`).

The kind, from these thresholds (the first that holds):
`first-token` if first ≥ 0.5, `previous-token` if previous ≥ 0.5, `self` if self ≥ 0.5, `induction` if
induction ≥ 0.5 (the largest of the four wins when several hold; the next of those that hold is the head's
second kind, `kind_also`), `broad` if spread ≥ 0.85, `local` if
distance ≤ 2, else `mixed`. On a vision tower's tokens (an image's patch grid, gridstats.py) there is no
`previous-token`, and `local` is a mean distance on the grid of at most 1.5 patches (the 8 neighbours lie at 1
and √2); each head also gets its `grid_stats` there, and a vision-language model's prompt gets them for its image.
(0.85 rather than 0.9: on all-MiniLM-L6-v2 the heads of layer 0 that look even across the sentence reach
0.85 to 0.90, and a spread of 0.85 is still about n^0.85 keys alike, 9 of 13; docs/heads.md.)

A linear attention layer's `effective_attention` (linear_attention.py) is not a distribution: its rows need not
sum to 1 and its entries may be negative. Its statistics are those of each row's share of |M|
(`|M[i, j]| / Σ_j |M[i, j]|`, `shares`): where the row's weight goes, whatever its sign; `is_effective` tells
such a matrix from a softmax pattern (a negative entry, or a row summing past 1).

`LayerHeads` is every head of one layer (one batch element) with its statistics and kind, as `--all-heads`
shows them and a notebook draws them.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from torch import Tensor

    from attnscope.readings.gridstats import Layout

KINDS = ("first-token", "previous-token", "self", "induction", "broad", "local", "mixed")
TEXT_ONLY = ("previous-token", "induction")  # kinds a vision tower's patch grid never gives (`kind`)
DOMINANT = 0.5  # first, previous, self or induction at least this: the head's kind is that position
BROAD = 0.85  # spread at least this: close to uniform over what each query may see
LOCAL = 2.0  # mean attended distance at most this many positions
LOCAL_PATCHES = 1.5  # a vision tower: mean distance on the patch grid at most this many patches (gridstats.py)
GROUP_CELLS = 1 << 21  # describe_heads: heads a call, at most this many pattern cells (16 MiB in float64)


@dataclass(frozen=True)
class HeadStats:
    entropy: float
    first: float
    previous: float
    self: float
    distance: float
    spread: float
    induction: float | None = None  # None where the tokens are not known (random inputs)

    def as_dict(self) -> dict[str, float]:
        # the fields in their order, as asdict gives them without its deep copy (512 heads: a tenth of the stats)
        return {name: value for name, value in vars(self).items() if value is not None}


def head_stats(pattern: Tensor, offset: int = 0, tokens: Sequence[int] | None = None,
               causal: bool | None = None) -> HeadStats:
    """The statistics of one `[n_Q, n_K]` pattern (computed in float64); `tokens`, the token at each key
    position, for the induction mass; `causal`, whether no query attends past itself, where already known."""
    import torch

    A = pattern.detach().to(torch.float64)
    if is_effective(A):
        A = shares(A)
    if causal is None:
        causal = bool(causal_rows(A, offset))
    rows = RowStats()
    rows.add(A, offset, causal, tokens)
    return rows.result()


SECONDS = re.compile(r"\d+\.\d\ds")  # an audio position's label, the time it starts at (models/audio.py)


def audio_times(labels: Sequence[str]) -> list[float] | None:
    """Whisper's encoder positions, labelled by the time each starts at (models/audio.py's `position_labels`:
    `0.00s`, `0.02s`, ...), as seconds; None for any other labels (a text's tokens, an image's)."""
    if not labels or labels[0] != "0.00s" or not all(SECONDS.fullmatch(label) for label in labels):
        return None
    times = [float(label[:-1]) for label in labels]
    return None if any(b < a for a, b in zip(times, times[1:], strict=False)) else times


def no_repeat(tokens: Sequence[int], image: Sequence[bool]) -> list[int]:
    """The ids the induction score reads: a VLM's image tokens (`image` true) all hold one placeholder id, so each
    is given its own (-1 - position), never a repeat and followed by none."""
    return [-1 - t if t < len(image) and image[t] else token for t, token in enumerate(tokens)]


def is_effective(attention: Tensor) -> bool:
    """Whether `[..., n_Q, n_K]` is a linear layer's exact matrix rather than a softmax pattern: a negative entry,
    or a row summing past 1 (a softmax row sums to 1, less with a sink, 0 where the mask hides every key; 1e-2 of
    slack for a half-precision pattern's rounding)."""
    return bool((attention < 0).any() or (attention.sum(dim=-1) > 1 + 1e-2).any())


def shares(attention: Tensor) -> Tensor:
    """Each row's share of |A|, `|A[i, j]| / Σ_j |A[i, j]|` (a row of zeros stays zeros): what the statistics read
    of a matrix that is not a distribution (module docstring)."""
    magnitude = attention.abs()
    total = magnitude.sum(dim=-1, keepdim=True)
    return magnitude / total.where(total > 0, 1.0)


def causal_rows(attention: Tensor, offset: int = 0) -> Tensor:
    """Whether each `[n_Q, n_K]` pattern in `attention` (`[..., n_Q, n_K]`) puts no weight past query i's own
    position i + offset: a boolean per pattern. One `triu` over all of them (torch's triu costs milliseconds a
    call on this machine, whatever the size: 512 heads' calls took 1.7 s of a 16-layer --all-layers run)."""
    return (attention.triu(diagonal=offset + 1) == 0).flatten(-2).all(dim=-1)


class RowStats:
    """The statistics gathered row by row: a pattern can be added in blocks of query rows (a long input whose
    whole `[n_Q, n_K]` is never held) and gives the same numbers as all of it at once. Each statistic is a mean
    over the rows it applies to (module docstring)."""

    NAMES = ("entropy", "first", "previous", "self", "distance", "spread", "induction")

    def __init__(self) -> None:
        self.sums = dict.fromkeys(self.NAMES, 0.0)
        self.counts = dict.fromkeys(self.NAMES, 0)
        self.tokens_known = False

    def add(self, A: Tensor, first_position: int, causal: bool, tokens: Sequence[int] | None = None) -> None:
        """Rows of a pattern, `[n_rows, n_K]` float64, the first at position `first_position`; `causal`: nothing
        above the diagonal (a row sees p + 1 keys)."""
        import torch

        self.take(*row_sums(A[None], first_position, torch.tensor([causal]), tokens))

    def take(self, sums: Mapping[str, Tensor | list[float]], counts: Mapping[str, Tensor | list[int]],
             pattern: int = 0) -> None:
        """Pattern `pattern`'s part of what `row_sums` gave (its tensors, or the same as lists)."""
        for name in sums:
            self.sums[name] += float(sums[name][pattern])
            self.counts[name] += int(counts[name][pattern])
        self.tokens_known |= "induction" in sums

    def result(self) -> HeadStats:
        means = {name: self.sums[name] / self.counts[name] if self.counts[name] else 0.0 for name in self.NAMES}
        induction = means.pop("induction")
        return HeadStats(**means, induction=induction if self.tokens_known else None)


def row_sums(A: Tensor, first_position: int, causal: Tensor, tokens: Sequence[int] | None = None, *,
             mass: Tensor | None = None,
             pairs: InductionPairs | None = None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Each statistic's sum over the rows it applies to, and how many rows that is, for each of G patterns at
    once (`[G, n_rows, n_K]` float64, weights >= 0, row i at position `first_position + i`; `causal` `[G]`
    bool): `[G]` each. "induction" only where `tokens` (or their `pairs`, made once for many calls) are given;
    `mass`, `A.sum(dim=-1)` where the caller has it. All heads of a layer go in one call: per-head calls cost a
    few milliseconds each in torch's overhead, whatever the size (512 of them were 0.3 s of a 16-layer run)."""
    import torch

    G, n_rows, n_K = A.shape
    position = torch.arange(n_rows, dtype=torch.float64) + first_position  # [n_rows]
    p = position.long()
    mass = A.sum(dim=-1) if mass is None else mass  # [G, n_rows]
    seen = mass > 0  # queries that may see some key
    entropy = _entropy(A) / math.log(2)  # [G, n_rows], bits (0 log 0 = 0)
    keys = torch.arange(n_K, dtype=torch.float64)
    if bool(causal.all()):  # every key at or before its query: |p - j| = p - j, a matmul
        distance = position * mass - A @ keys  # [G, n_rows, n_K] @ [n_K] -> [G, n_rows]
    else:
        distance = (A * (position[:, None] - keys[None, :]).abs()).sum(dim=-1)
    visible = torch.where(causal[:, None], (position + 1).clamp(max=n_K), float(n_K))  # [G, n_rows]
    last = max(n_K - 1, 0)  # a pattern with no keys has no rows seen: the gathers below read a zero column
    padded = A if n_K else torch.zeros(G, n_rows, 1, dtype=A.dtype)

    def at(index: Tensor) -> Tensor:  # [G, n_rows]: each row's weight on key index[i]
        return padded.gather(-1, index.clamp(0, last).expand(G, n_rows)[..., None])[..., 0]

    values = {"entropy": (entropy, seen), "first": (padded[..., 0], seen),
              "previous": (at(p - 1), seen & (p >= 1) & (p - 1 < n_K)), "self": (at(p), seen & (p < n_K)),
              "distance": (distance, seen),
              "spread": (entropy / torch.log2(visible.clamp_min(2)), seen & (visible >= 2))}
    if tokens is not None or pairs is not None:
        induction = pairs.rows(A, first_position) if pairs is not None else induction_rows(A, p, tokens or [])
        values["induction"] = (induction, seen & ~induction.isnan())
    sums = {name: torch.where(rows, value, 0.0).sum(dim=-1) for name, (value, rows) in values.items()}
    counts = {name: rows.sum(dim=-1) for name, (_, rows) in values.items()}
    return sums, counts


def _entropy(A: Tensor) -> Tensor:
    """`-Σ_j A[.., j] ln A[.., j]` over the last axis (0 ln 0 = 0; a NaN stays NaN), `[..]`: `A · ln(max(A, tiny))`,
    ln over the whole tensor once, in place (torch's xlogy takes its logarithms one number at a time: 2.5 times
    as long on a block of a pattern). Weights >= 0: a weight below float64's smallest normal number (never one
    made from float32) would count as that number."""
    import torch

    logs = A.clamp_min(torch.finfo(A.dtype).tiny).log_()  # [.., n_K]
    return -logs.mul_(A).sum(dim=-1)


class InductionPairs:
    """`induction_rows`' keys, listed once for many blocks of rows (readings/layerdigest.py's every layer): for
    each position p, the keys k with 1 <= k < p whose previous token is p's (`tokens[k - 1] == tokens[p]`), as
    pairs (p, k) in order of p, then k. A block's induction mass is then a sum over its pairs, not a product with
    a `[n_rows, n_K]` mask: the same numbers up to the order of float64 additions. None (`of`) where the pairs
    would outnumber MAX_PAIRS a token (a text that repeats one token throughout: n²/2 pairs)."""

    MAX_PAIRS = 64

    def __init__(self, queries: Tensor, keys: Tensor, n_tokens: int) -> None:
        import torch

        self.queries, self.keys = queries, keys  # [n_pairs] each, long
        # pairs of positions before p: where p's own pairs start in the list, [n_tokens + 1]
        self.starts = torch.searchsorted(queries, torch.arange(n_tokens + 1)).tolist()

    @classmethod
    def of(cls, tokens: Sequence[int]) -> InductionPairs | None:
        import torch

        earlier: dict[int, list[int]] = {}  # each token's positions so far
        queries: list[int] = []
        keys: list[int] = []
        limit = cls.MAX_PAIRS * max(1, len(tokens))
        for p, token in enumerate(tokens):
            seen = earlier.setdefault(token, [])
            before = [j + 1 for j in seen if j <= p - 2]  # keys j + 1 < p after an earlier occurrence j
            queries += [p] * len(before)
            keys += before
            if len(keys) > limit:
                return None
            seen.append(p)
        return cls(torch.tensor(queries, dtype=torch.long), torch.tensor(keys, dtype=torch.long), len(tokens))

    def rows(self, A: Tensor, first_position: int) -> Tensor:
        """`induction_rows(A, positions, tokens)` for rows at positions first_position.. of `[G, n_rows, n_K]`
        float64: `[G, n_rows]`, NaN for a row with no pair."""
        import torch

        G, n_rows, n_K = A.shape
        last = min(first_position + n_rows, len(self.starts) - 1)
        lo, hi = self.starts[min(first_position, last)], self.starts[last]
        rows, keys = self.queries[lo:hi] - first_position, self.keys[lo:hi]  # [m]: each pair's row and key
        if bool((keys >= n_K).any()):  # keys past the block's (a block cut short): not among its weights
            rows, keys = rows[keys < n_K], keys[keys < n_K]
        cells = rows * n_K + keys  # [m]: its cell in a row-major [n_rows, n_K]
        mass = torch.zeros(G, n_rows, dtype=A.dtype).index_add_(1, rows, A.reshape(G, -1).index_select(1, cells))
        has = torch.zeros(n_rows, dtype=torch.bool)
        has[rows] = True
        return torch.where(has, mass, torch.nan)


def induction_rows(A: Tensor, positions: Tensor, tokens: Sequence[int]) -> Tensor:
    """`[..., n_rows]` for patterns `[..., n_rows, n_K]`: each query row's weight on the keys that followed
    earlier occurrences of its token (NaN for a row whose token did not occur before: it has no induction
    target). `positions`: each row's position."""
    import torch

    ids = torch.tensor(list(tokens), dtype=torch.long)  # [n_tokens], the token at each position
    n_K = A.shape[-1]
    keys = torch.arange(n_K)
    p = positions.clamp(max=ids.numel() - 1)
    before = torch.cat([ids[:1], ids[: n_K - 1]])  # the token just before each key position (key j + 1 follows j)
    follows = (keys[None, :] >= 1) & (keys[None, :] < positions[:, None]) & (before[None, :] == ids[p][:, None])
    follows &= (positions < ids.numel())[:, None]  # [n_rows, n_K]
    mass = (A * follows).sum(dim=-1)
    return torch.where(follows.any(dim=-1), mass, torch.nan)


def kind(stats: HeadStats, grid: dict[str, float | None] | None = None) -> str:
    """One word for what the head does (thresholds in this module's docstring and docs/heads.md). `grid`: a vision
    tower's grid figures (gridstats.py), where the previous token and a distance in positions mean nothing: no
    `previous-token`, and `local` is a mean distance on the grid of at most LOCAL_PATCHES patches."""
    positional = {"first-token": stats.first, "previous-token": stats.previous, "self": stats.self,
                  "induction": stats.induction or 0.0}
    if grid is not None:
        del positional["previous-token"]
    name, mass = max(positional.items(), key=lambda item: item[1])
    if mass >= DOMINANT:
        return name
    if stats.spread >= BROAD:
        return "broad"
    if grid is None and stats.distance <= LOCAL:
        return "local"
    distance = None if grid is None else grid["distance"]
    if distance is not None and distance <= LOCAL_PATCHES:
        return "local"
    return "mixed"


def kind_also(stats: HeadStats, grid: dict[str, float | None] | None = None) -> str | None:
    """A head's second kind: where two positions each hold at least DOMINANT (SmolLM2's layer 18 head 6 puts 0.73
    on the first token and 0.56 on the tokens that followed earlier occurrences: first-token, then induction), the
    smaller; None where only one does (or none)."""
    positional = {"first-token": stats.first, "previous-token": stats.previous, "self": stats.self,
                  "induction": stats.induction or 0.0}
    if grid is not None:
        del positional["previous-token"]
    held = sorted(((mass, name) for name, mass in positional.items() if mass >= DOMINANT), reverse=True)
    return held[1][1] if len(held) > 1 else None


def describe(pattern: Tensor, offset: int = 0, tokens: Sequence[int] | None = None) -> tuple[str, dict[str, float]]:
    """A head's kind and statistics, as the explorer page shows them (views/sources.py's `Describe`)."""
    stats = head_stats(pattern, offset, tokens)
    return kind(stats), stats.as_dict()


def describe_heads(attention: Tensor, offset: int = 0, tokens: Sequence[int] | None = None,
                   grid: Layout | None = None) -> list[dict[str, Any]]:
    """Every head of one batch element, `[n_head, n_Q, n_K]`: `{"head", "stats", "kind"}` per head, and
    `"grid_stats"` where the tokens are an image's patch grid (`grid`, gridstats.py). Heads go through `row_sums`
    together, as many at a time as fit in GROUP_CELLS cells (a long text's heads one by one)."""
    return _described(attention, offset, tokens, grid)[0]


def _described(attention: Tensor, offset: int, tokens: Sequence[int] | None,
               grid: Layout | None) -> tuple[list[dict[str, Any]], bool]:
    """`describe_heads`, and whether the patterns are a linear layer's exact matrices (`is_effective` of them all:
    any group's, since both of its tests are "any"). On one thread (tensors/threads.py's `one_thread`): some thirty
    ops a layer, each waiting for both threads on the busy 2-core machine (docs/performance.md)."""
    import torch

    from attnscope.readings.gridstats import grid_figures
    from attnscope.tensors.threads import one_thread

    heads: list[dict[str, Any]] = []
    n_head, n_Q, n_K = attention.shape
    group = max(1, GROUP_CELLS // max(1, n_Q * n_K))
    effective = False
    with one_thread():
        causal = causal_rows(attention.detach(), offset)  # every head at once: one triu a layer, not a head
        for first in range(0, n_head, group):
            A = attention[first: first + group].detach().to(torch.float64)
            if is_effective(A):
                effective = True
                A = shares(A)
            sums, counts = row_sums(A, offset, causal[first: first + group], tokens)
            # [G] each, as Python numbers once: `take` reads one head's of each (a tensor read 14 times a head)
            sum_of = {name: value.tolist() for name, value in sums.items()}
            count_of = {name: value.tolist() for name, value in counts.items()}
            figures = grid_figures(A, grid) if grid is not None else None
            for g in range(A.shape[0]):
                rows = RowStats()
                rows.take(sum_of, count_of, g)
                stats = rows.result()
                tower = figures[g] if figures is not None and grid is not None and grid.tower else None
                head = {"head": first + g, "stats": stats.as_dict(), "kind": kind(stats, tower),
                        "kind_also": kind_also(stats, tower)}
                if figures is not None:
                    head["grid_stats"] = figures[g]
                heads.append(head)
    return heads, effective


@dataclass
class LayerHeads:
    """Every head of one layer, for one batch element: the patterns `[n_head, n_Q, n_K]`, their axis labels,
    where query 0 sits (`offset`: query i is at position i + offset), and each head's `{"head", "stats",
    "kind"}` (`describe_heads`). `batch` is the batch element (None for a model's single sequence)."""

    notebook_view: ClassVar[Callable[[LayerHeads], str] | None] = None  # how Jupyter shows it, handed in from above

    title: str
    attention: Tensor
    row_labels: list[str]
    col_labels: list[str]
    offset: int = 0
    batch: int | None = None
    heads: list[dict[str, Any]] = field(default_factory=list)
    masked: Tensor | None = None  # [n_head, n_Q, n_K], True where the mask hid the key (None: not known)
    value_norms: Tensor | None = None  # [n_head, n_K] float64, ||f_h(x_j)|| (readings/moved.py); None: not known
    sink_weight: Tensor | None = None  # [n_head, n_Q], a learned sink's weight (GPT-OSS); None: no sinks
    _shares: list[dict[str, Any]] | None = field(default=None, repr=False)  # sinks_share(), once computed
    effective: bool = False  # a linear layer's exact matrix M, not a softmax (is_effective): rows need not sum to 1
    grid: Layout | None = None  # where the tokens are an image's patch grid (gridstats.py): each head's grid_stats

    @classmethod
    def of(cls, attention: Tensor, title: str, row_labels: list[str] | None = None,
           col_labels: list[str] | None = None, offset: int = 0, batch: int | None = None,
           tokens: Sequence[int] | None = None, masked: Tensor | None = None, value_norms: Tensor | None = None,
           sink_weight: Tensor | None = None) -> LayerHeads:
        """`tokens`: the token id at each key position, where known (a model's text), for induction heads;
        `masked`: where the mask hid a key (masks.hidden of the `masked_scores` step); `value_norms` and
        `sink_weight` for what each head moves and where it parks its weight (moved.py, sinkshare.py)."""
        from attnscope.readings.gridstats import PATCH, layout

        n_Q, n_K = attention.shape[-2:]
        if masked is not None and masked.shape != attention.shape:
            masked = None
        # an image's patches among the keys (p(r,c), img(r,c)), where the queries are the same tokens
        grid = layout(col_labels) if col_labels and row_labels == col_labels and not offset else None
        if grid is not None and len(grid.image) != n_K:
            grid = None
        if tokens is not None and col_labels:
            tokens = no_repeat(tokens, [bool(PATCH.match(label)) for label in col_labels])
        heads, effective = _described(attention, offset, tokens, grid)  # is_effective read once, group by group
        return cls(title, attention, row_labels or [f"q{i}" for i in range(n_Q)],
                   col_labels or [f"k{j}" for j in range(n_K)], offset, batch, heads, masked, value_norms,
                   sink_weight, effective=effective, grid=grid)

    def columns(self) -> list[tuple[str, str, str, str]]:
        """What a table of these heads shows after the head and its kind, `(title, entry, key, format)` with
        `entry` "stats" or "grid_stats": a text's figures; on a vision tower's patch grid the entropy, then the
        grid's (gridstats.py: the special tokens where the model has them) in place of the first token, previous
        and distance in positions; a VLM's text adds its share on the image."""
        first = "first token" if audio_times(self.col_labels) is None else self.col_labels[0]  # Whisper's 0.00s
        text = [("entropy", "stats", "entropy", ".2f"), (first, "stats", "first", ".2f"),
                ("previous", "stats", "previous", ".2f"), ("self", "stats", "self", ".2f"),
                ("distance", "stats", "distance", ".1f")]
        if self.grid is None:
            return text
        if not self.grid.tower:
            return [*text, ("image", "grid_stats", "text_to_image", ".2f")]
        special = [(title, "grid_stats", key, ".2f") for title, key, tokens in (
            ("[CLS]", "cls", self.grid.cls), ("[DIST]", "distillation", self.grid.distillation),
            ("registers", "registers", self.grid.registers)) if tokens]
        return [text[0], *special, *((title, "grid_stats", key, ".2f") for title, key in (
            ("self", "self"), ("row", "row"), ("column", "column"), ("8 nbrs", "neighbours"))),
            ("distance", "grid_stats", "distance", ".1f")]

    def flat_stats(self, head: dict[str, Any]) -> dict[str, Any]:
        """One head's statistics as one flat dict, as the explorer page takes them (views/sources.py): `stats`,
        and on a patch grid its `grid_stats` as `grid_distance`, `grid_row`, ..., with `grid_tower` (a vision
        tower's tokens, where the page shows the grid's figures in place of previous and distance)."""
        if self.grid is None or "grid_stats" not in head:
            return dict(head["stats"])
        return head["stats"] | {f"grid_{name}": value for name, value in head["grid_stats"].items()} | {
            "grid_tower": self.grid.tower}

    def weighted(self) -> Tensor | None:
        """The value-weighted patterns `[n_head, n_Q, n_K]` float64 (readings/moved.py); None without value_norms."""
        from attnscope.readings.moved import weighted

        return None if self.value_norms is None else weighted(self.attention, self.value_norms)

    def moved(self) -> list[float] | None:
        """Each head's mean total moved per query (readings/moved.py); None without value_norms."""
        from attnscope.readings.moved import moved

        weights = self.weighted()
        return None if weights is None else moved(weights, self.attention).tolist()

    def sinks_share(self) -> list[dict[str, Any]]:
        """Each head's shares on the first token, a learned sink and the top keys (readings/sinkshare.py),
        computed once (the terminal, JSON and the page each ask)."""
        from attnscope.readings.sinkshare import sink_shares

        if self._shares is None:
            self._shares = sink_shares(self.attention, self.sink_weight, self.value_norms)
        return self._shares

    def _repr_html_(self) -> str:
        """Jupyter draws every head as a small heatmap with its kind, and the table of statistics, through
        `notebook_view`, which the package hands in (attnscope/__init__.py: views/embed.py), so that readings/ imports
        no view; without one, the title as text."""
        if LayerHeads.notebook_view is None:
            return f"<pre>{html.escape(self.title)}</pre>"
        return LayerHeads.notebook_view(self)
