"""Every layer's readings taken as the layer comes, its patterns then let go: what the terminal's `--all-layers`
view shows of a long text (models/forward/stream.py hands each layer in; runs/streamed_layers.py says when).

One pass a layer over blocks of query rows, each block made float64 once and read by all of:

- each head's statistics and kind (headstats.py's `row_sums`, gathered block by block in `RowStats`, as the
  long path gathers one head's);
- where each head parks its weight (sinkshare.py's shares: sums over the rows kept, the keys' column sums added
  up block by block, the top keys sorted at the end), with the value norms where the layer has them;
- the grid's thumbnail of each head (views/pooling.py's `pool`: each row's keys summed into groups as the rows
  come, the query groups averaged at the end: the same numbers as pooling the whole pattern);
- the rollout's three layer matrices, rows by rows (rollout.py's `layer_matrix` is row by row), kept in float32
  by `LastRows` for the last query's row at the end.

A causal layer's block of rows f..l - 1 reads keys 0..l - 1 only (nothing above the diagonal: zeros), so half the
pattern is never made float64. The numbers are the whole pattern's up to the order of float64 additions (a
mean's rows summed block by block), and for the rollout the float32 of what is kept (tests/test_streamed_layers.py
compares them with the whole path's and with transformers' eager output_attentions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnscope.readings.headstats import GROUP_CELLS, InductionPairs, LayerHeads, RowStats, kind, kind_also

if TYPE_CHECKING:
    from torch import Tensor

BLOCK_CELLS = 1 << 19  # float64 cells of one block of rows, every head's (4 MiB; a few such at once)


@dataclass
class StreamedHeads(LayerHeads):
    """A layer's heads whose patterns were read as they came and not kept: `attention` is a meta tensor (its
    shape only), the sink shares are computed already, and `thumbnail` holds the grid's pooled pattern."""

    thumbnail: Tensor | None = None  # [n_head, rows, cols] float64: pool(the patterns, *thumb)


class SinkSums:
    """sinkshare.py's `shares` gathered over blocks of rows: the weight on key 0 over the rows kept, and each key's
    column sum, for the top keys."""

    def __init__(self, n_head: int, n_K: int) -> None:
        import torch

        self.first = torch.zeros(n_head, dtype=torch.float64)
        self.columns = torch.zeros(n_head, n_K, dtype=torch.float64)
        self.rows = torch.zeros(n_head, dtype=torch.long)

    def add(self, A: Tensor, keep: Tensor) -> None:
        """Rows of row-normalised weights `[n_head, n_rows, n_keys]` float64 (keys 0..n_keys - 1) and the rows
        kept `[n_head, n_rows]`."""
        import torch

        kept = A if bool(keep.all()) else torch.where(keep[..., None], A, 0.0)
        self.rows += keep.sum(dim=-1)
        if A.shape[-1]:
            self.first += kept[..., 0].sum(dim=-1)
            self.columns[:, : A.shape[-1]] += kept.sum(dim=1)

    def shares(self) -> tuple[list[float], list[float], list[list[int]]]:
        """Each head's mean weight on key 0 and on its top keys, and those keys (sinkshare.py's `shares`)."""
        from attnscope.readings.sinkshare import TOP

        rows = self.rows.clamp_min(1)
        keys = self.columns.sort(dim=-1, descending=True, stable=True).indices[:, : min(TOP, self.columns.shape[-1])]
        top = self.columns.gather(-1, keys).sum(dim=-1) / rows
        return (self.first / rows).tolist(), top.tolist(), keys.tolist()


class EveryLayer:
    """The readings of every layer, a layer at a time (`add`), for rows and columns labelled `row_labels` and
    `col_labels` (a text's tokens: a self-attention, queries and keys alike), `tokens` the ids for induction,
    `thumb` the grid's pooling (query rows, keys) a cell, and `n_layer` layers at the most."""

    def __init__(self, row_labels: list[str], col_labels: list[str], tokens: Sequence[int] | None,
                 thumb: tuple[int, int], n_layer: int) -> None:
        from attnscope.readings.gridstats import PATCH
        from attnscope.readings.headstats import no_repeat
        from attnscope.readings.rollout import LastRows

        self.row_labels, self.col_labels, self.thumb = row_labels, col_labels, thumb
        self.tokens = no_repeat(tokens, [bool(PATCH.match(label)) for label in col_labels]) if tokens else tokens
        self.pairs = InductionPairs.of(self.tokens) if self.tokens else None  # induction's keys, listed once
        self.layers: list[StreamedHeads] = []
        self.chains, self.n_layer = LastRows(len(col_labels), n_layer), n_layer
        self.weighted = True  # every layer so far had its value norms: the value-weighted rollout is known
        self.groups: Tensor | None = None  # [n_K, ceil(n_K / cols)]: the thumbnail's key groups, 0/1 (`_keyed`)
        self.worker: Behind | None = None  # the thread that reads the layers, where asked (`behind`)

    def add(self, index: int, attention: Tensor, norms: Tensor | None, sink: Tensor | None) -> None:
        """Layer `index`'s patterns `[n_head, n, n]`, value norms `[n_head, n]` and learned sinks' weights
        `[n_head, n]` (None where it has none), read in one pass of row blocks."""

        self.weighted &= norms is not None
        self.later(lambda: self.layers.append(self._read(index, attention.detach(), norms, sink)))

    def later(self, work: Callable[[], None]) -> None:
        """Run `work` on one thread (some forty small ops a block, each waiting for both threads on a busy
        machine): behind the caller on a thread of its own when `behind()` was asked (in order), else now."""
        from attnscope.tensors.threads import one_thread

        if self.worker is not None:
            self.worker.put(work)
            return
        with one_thread():
            work()

    def behind(self) -> Behind:
        """Read the layers on a thread of their own from now on, while the caller runs the next layer (the two
        cores of a quiet machine each take one); `close()` the result to wait for the last."""
        self.worker = Behind()
        return self.worker

    def _read(self, index: int, A: Tensor, norms: Tensor | None, sink: Tensor | None) -> StreamedHeads:
        n_head, n_Q, n_K = A.shape
        layer = LayerReads(self, index, A.shape, _causal(A), norms, sink)
        step = max(1, BLOCK_CELLS // max(1, n_head * n_K))
        for f in range(0, n_Q, step):
            layer.rows(f, A[:, f: f + step])
        return layer.finish(A)

    def by_rows(self, index: int, n_head: int, n: int, W_O: Tensor | None) -> RowsRead:
        """A reader of layer `index`'s pattern in blocks of rows as the attention makes them (attention/rows.py's
        `reading`): a causal self-attention over `n` tokens, every head's keys from 0, `W_O` its output
        projection's weight for the value norms (None: none); `finish()` once the layer has run."""
        return RowsRead(self, index, n_head, n, W_O)

    def _keyed(self, rows: Tensor, B: Tensor, total: Tensor, n_K: int) -> Tensor:
        """The thumbnail's key groups of a block: `pool(rows, 1, cols)` (`rows` the float32 pattern's rows, their
        first keys of n_K, the rest 0), taken as the product of the block's float64 `B` (its first keys, the rest
        0) with a 0/1 matrix of the groups: the same sums in another order, a tenth of the time of unfold's
        float64 sums. A row with a NaN (its `total` NaN) is pooled as it is, so the NaN stays in its own cell."""
        import torch

        from attnscope.views.pooling import pool

        cols = self.thumb[1]
        if cols <= 1 or bool(total.isnan().any()):
            return pool(torch.nn.functional.pad(rows, (0, n_K - rows.shape[-1])), 1, cols)  # keys past the rows': 0
        if self.groups is None or self.groups.shape[0] != n_K:
            groups = torch.arange(n_K) // cols  # [n_K]: each key's group
            self.groups = torch.nn.functional.one_hot(groups, int(groups[-1]) + 1).to(torch.float64)  # [n_K, m]
        return B @ self.groups[: B.shape[-1]]  # [n_head, n_rows, keys] @ [keys, m] -> [n_head, n_rows, m]

    def _put(self, chain: str, first_row: int, block: Tensor, index: int) -> None:
        """Rows of layer `index`'s M to keep; of the last layer only the last row, the one `e_last ·` reads (the
        rest of its packed rows are never written, so never take memory)."""
        if index < self.n_layer - 1:
            self.chains.put(chain, first_row, block)
        else:
            self.chains.put(chain, first_row + block.shape[0] - 1, block[-1:])

    def _shares_stats(self, A: Tensor, causal: Tensor, effective: list[bool]) -> list[RowStats]:
        """The statistics again, each row of an effective head as its share of |M| (headstats.shares)."""
        import torch

        from attnscope.readings.headstats import row_sums, shares

        n_head, n_Q, n_K = A.shape
        gathered = Gathered()
        step = max(1, BLOCK_CELLS // max(1, n_head * n_K))
        for f in range(0, n_Q, step):
            B = A[:, f: f + step].to(torch.float64)
            for h in range(n_head):
                if effective[h]:
                    B[h] = shares(B[h])
            gathered.add(*row_sums(B, f, causal, self.tokens if self.pairs is None else None, pairs=self.pairs))
        return gathered.stats(n_head)

    def rollout_rows(self) -> dict[str, Tensor]:
        """The last query's row of each rollout, `[1, n]` (rollout.py's `last_rows` keys): the value-weighted one
        where every layer had its value norms."""
        rows = self.chains.rows()
        if not self.weighted:
            rows.pop("rollout_weighted", None)
        if len(self.col_labels) <= 1:
            rows.pop("rollout_without_first", None)
        return rows


class LayerReads:
    """One layer's readings gathered block of rows by block (`rows`), then made its `StreamedHeads` (`finish`):
    `shape` `[n_head, n_Q, n_K]`, `causal` `[n_head]` bool (nothing above the diagonal: a block's rows f..e - 1
    are read on keys 0..e - 1 when every head is)."""

    def __init__(self, owner: EveryLayer, index: int, shape: Any, causal: Tensor, norms: Tensor | None,
                 sink: Tensor | None) -> None:
        import torch

        n_head, n_Q, n_K = shape
        self.owner, self.index, self.shape, self.causal = owner, index, shape, causal
        self.norms, self.sink = norms, sink
        self.every = bool(causal.all())
        owner.chains.start(self.every)
        self.sinks, self.weighted = SinkSums(n_head, n_K), SinkSums(n_head, n_K) if norms is not None else None
        self.parked = torch.zeros(n_head, dtype=torch.float64)
        self.effective = torch.zeros(n_head, dtype=torch.bool)
        self.gathered = Gathered()
        self.keyed: list[Tensor] = []  # each block's rows with their keys summed in groups: [n_head, n_rows, m]

    def rows(self, f: int, A: Tensor) -> None:
        """Rows f.. of the pattern, float32 `[n_head, n_rows, keys]`: every key, or (a causal layer) at least
        keys 0..f + n_rows - 1."""
        import torch

        from attnscope.readings.headstats import row_sums
        from attnscope.readings.rollout import layer_matrix, row_normalised, without_first

        owner, index, norms, sink = self.owner, self.index, self.norms, self.sink
        _, n_Q, n_K = self.shape
        end = f + A.shape[1]
        keys = min(end, n_K) if self.every else n_K  # a causal block's rows see keys 0..end - 1
        B = A[:, :, :keys].to(torch.float64)  # [n_head, n_rows, keys]: the block, made float64 once
        total = B.sum(dim=-1)  # [n_head, n_rows]
        self.keyed.append(owner._keyed(A, B, total, n_K))  # [n_head, n_rows, ceil(n_K / cols)]
        self.effective |= _negative(B) | (total > 1 + 1e-2).any(dim=1)  # headstats.is_effective
        self.gathered.add(*row_sums(B, f, self.causal, owner.tokens if owner.pairs is None else None, mass=total,
                                    pairs=owner.pairs))
        s = None if sink is None else sink[:, f:end].to(torch.float64)  # [n_head, n_rows]
        keep = (total + (s if s is not None else 0.0)) > 0  # rows that give weight somewhere
        self.sinks.add(B, keep)
        if s is not None:
            self.parked += torch.where(keep, s, 0.0).sum(dim=-1)
        rolled = index < owner.n_layer - 1 or end == n_Q  # of the last layer only its last row is read
        if rolled:
            owner._put("rollout", f, layer_matrix(B, f), index)
        if rolled and n_K > 1:
            owner._put("rollout_without_first", f, layer_matrix(
                row_normalised(without_first(B), in_place=True), f), index)
        if norms is not None and self.weighted is not None:  # moved.weighted as shares, in B's place
            W = B.mul_(norms[:, None, :keys].to(torch.float64))  # [n_head, n_rows, keys]: ||a_ij f_h(x_j)||
            moved = W.sum(dim=-1)  # [n_head, n_rows]
            share = W.div_(torch.where(moved > 0, moved, 1.0)[..., None])  # rollout.row_normalised's numbers
            self.weighted.add(share, moved > 0)
            if owner.weighted and rolled:
                owner._put("rollout_weighted", f, layer_matrix(share, f), index)

    def finish(self, A: Tensor | None = None) -> StreamedHeads:
        """The layer's heads; `A`, the whole pattern where it is held (a linear layer's exact matrix is read
        again as shares: `_shares_stats`)."""
        import torch

        from attnscope.views.pooling import pool

        owner, (n_head, n_Q, n_K) = self.owner, self.shape
        group = max(1, GROUP_CELLS // max(1, n_Q * n_K))  # headstats._described's groups of heads
        groups = [bool(self.effective[g: g + group].any()) for g in range(0, n_head, group)]
        stats = self.gathered.stats(n_head)
        if any(groups):  # a linear layer's exact matrix: its statistics read each row's share of |M|, again
            assert A is not None, "a pattern read by rows is a softmax's"
            stats = owner._shares_stats(A, self.causal, [groups[h // group] for h in range(n_head)])
        heads = []
        for h, rows in enumerate(stats):
            result = rows.result()
            heads.append({"head": h, "stats": result.as_dict(), "kind": kind(result), "kind_also": kind_also(result)})
        return StreamedHeads(f"layer {self.index}", torch.empty(self.shape, device="meta"), owner.row_labels,
                             owner.col_labels, heads=heads, value_norms=self.norms, sink_weight=self.sink,
                             _shares=_share_dicts(self.sinks, self.weighted, self.parked if self.sink is not None
                                                  else None),
                             effective=any(groups), thumbnail=pool(torch.cat(self.keyed, dim=1), owner.thumb[0], 1))


class RowsRead:
    """EveryLayer's reader of one layer's blocks of rows as attention/rows.py's `eager_rows` makes them (its
    `RowsReader`): the value norms from the values of the first block, then each block read in pieces of
    BLOCK_CELLS float64 cells; `finish` adds the layer."""

    def __init__(self, owner: EveryLayer, index: int, n_head: int, n: int, W_O: Tensor | None) -> None:
        self.owner, self.index, self.n_head, self.n, self.W_O = owner, index, n_head, n, W_O
        self.norms: Tensor | None = None
        self.layer: LayerReads | None = None
        self.started = False

    def __call__(self, first: int, lo: int, hi: int, pattern: Tensor, V: Tensor) -> None:
        from attnscope.readings.moved import value_norms
        from attnscope.tensors.threads import one_thread

        assert lo == 0 and hi >= first + pattern.shape[-2], "a causal layer's rows read from key 0"
        if not self.started:  # the value norms now: the caller reads them once the layer has run
            self.started = True
            if self.W_O is not None:
                with one_thread():  # as value_norms' own products
                    self.norms = value_norms(V[0], self.W_O)  # [n_head, n]
            self.owner.weighted &= self.norms is not None
        self.owner.later(lambda: self._rows(first, pattern[0].detach()))

    def _rows(self, first: int, A: Tensor) -> None:
        """Rows first.. of the pattern, `[n_head, n_rows, keys]`, in pieces of BLOCK_CELLS."""
        import torch

        if self.layer is None:
            self.layer = LayerReads(self.owner, self.index, (self.n_head, self.n, self.n),
                                    torch.ones(self.n_head, dtype=torch.bool), self.norms, None)
        step = max(1, BLOCK_CELLS // max(1, self.n_head * self.n))
        for f in range(0, A.shape[1], step):
            self.layer.rows(first + f, A[:, f: f + step])

    def finish(self) -> None:
        """The layer's heads, added to the owner's layers (once its blocks are read)."""
        assert self.started, "the layer ran no attention by rows"

        def done() -> None:
            assert self.layer is not None
            self.owner.layers.append(self.layer.finish())

        self.owner.later(done)


class Behind:
    """A thread that runs the work `put` to it in order, on one torch thread, while the caller goes on: at most
    QUEUED pieces wait (each a layer's pattern or a block of it, so what waits stays a few of those); `close`
    waits for the last and raises what any raised."""

    QUEUED = 4

    def __init__(self) -> None:
        import queue
        import threading

        self.queue: queue.Queue[Callable[[], None] | None] = queue.Queue(self.QUEUED)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="attnscope-readings", daemon=True)
        self.thread.start()

    def put(self, work: Callable[[], None]) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put(work)

    def _run(self) -> None:
        import torch

        torch.get_num_threads()  # this thread's count made (from the process's) before it is set:
        torch.set_num_threads(1)  # OpenMP's count is a thread's own, so the caller's stays as it is
        while (work := self.queue.get()) is not None:
            if self.error is None:
                try:
                    with torch.no_grad():
                        work()
                except BaseException as error:  # handed to the caller at its next put or close
                    self.error = error

    def close(self) -> None:
        """Wait for every piece put; raise the first error one raised."""
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


class Gathered:
    """`row_sums`' sums and counts of every block, added up as tensors `[n_head]` (block after block: the same
    additions, in the same order, as `RowStats.take` of each block), then read as each head's `RowStats` once."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, Tensor] = {}

    def add(self, sums: dict[str, Tensor], counts: dict[str, Tensor]) -> None:
        for name in sums:
            if name in self.sums:
                self.sums[name] += sums[name]
                self.counts[name] += counts[name]
            else:
                self.sums[name], self.counts[name] = sums[name].clone(), counts[name].clone()

    def stats(self, n_head: int) -> list[RowStats]:
        sums = {name: value.tolist() for name, value in self.sums.items()}
        counts = {name: value.tolist() for name, value in self.counts.items()}
        stats = [RowStats() for _ in range(n_head)]
        for h, rows in enumerate(stats):
            rows.take(sums, counts, h)
        return stats


def _negative(B: Tensor) -> Tensor:
    """Whether each `[n_rows, n_K]` of `B` has a negative weight, `[n_head]`: from each one's smallest (a pass
    with no `[n_head, n_rows, n_K]` of booleans made), read again with `< 0` where a NaN hides it."""
    low = B.flatten(1).amin(dim=1) if B.numel() else B.new_zeros(B.shape[0])  # [n_head]
    if bool(low.isnan().any()):
        return (B < 0).flatten(1).any(dim=1)
    return low < 0


def _causal(A: Tensor) -> Tensor:
    """headstats.causal_rows of each `[n, n]` pattern, `[n_head]` bool, block of rows by block: whether nothing
    lies above the diagonal. A block's rows f..e - 1 read their keys from e on (all above) without a copy, and
    the square of keys f..e - 1 through `causal_rows`."""
    import torch

    from attnscope.readings.headstats import causal_rows

    n_head, n_Q, n_K = A.shape
    step = max(1, BLOCK_CELLS // max(1, n_head * n_K))
    causal = torch.ones(n_head, dtype=torch.bool)
    for f in range(0, n_Q, step):
        end = min(n_Q, f + step)
        if end < n_K:
            causal &= ~A[:, f:end, end:].any(dim=-1).any(dim=-1)  # any: not 0 (a NaN is not 0 either)
        causal &= causal_rows(A[:, f:end, f: min(end, n_K)])  # [n_head]: the block's own square
    return causal


def _share_dicts(sinks: SinkSums, weighted: SinkSums | None, parked: Tensor | None) -> list[dict[str, Any]]:
    """sinkshare.sink_shares' list of dicts, a head each, from the sums gathered."""
    first, top, keys = sinks.shares()
    columns: dict[str, Any] = {"first": first, "top": top, "top_keys": keys}
    if parked is not None:
        columns["sink"] = (parked / sinks.rows.clamp_min(1)).tolist()
    if weighted is not None:
        w_first, w_top, w_keys = weighted.shares()
        columns |= {"weighted_first": w_first, "weighted_top": w_top, "weighted_top_keys": w_keys}
    return [{key: values[h] for key, values in columns.items()} for h in range(len(first))]
