"""Attention rollout (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers"): which input tokens the
last layer's queries draw from, the layers' patterns chained.

Each layer l contributes `M_l = 0.5 · mean_heads(A_l) + 0.5 · I`, every row then divided by its sum (a row of a
GPT-OSS pattern sums to less than 1, its sink's share dropped; a row that sees no key becomes the identity's),
and the rollout is the product taken from layer 0 up: `R = M_L · ... · M_1 · M_0` `[n_Q, n_K]`, row i the
share of each input token in what reaches query i. For a decoder every M_l is lower triangular, so R is too:
the causal product. The value-weighted rollout puts, in place of each head's A, its value-weighted pattern
(moved.py) with every row divided by its total: the share of what the head moves that comes from each key.

What it assumes, and so where it misleads (docs/heads.md): the residual stream is taken as an identity worth as
much as all the heads together (the 0.5), the heads are averaged as if alike, the MLPs and norms are ignored,
and the tokens stay in their positions. It ranks input tokens; its numbers are not attributions.

On a decoder whose heads park most of their weight on the first token (a sink: Xiao et al. 2023), every row of
R reads about 1.00 on that token and about 0 elsewhere, in an order rounding decides. The rollout without the
first token (`Rollout(drop_first=True)`) zeroes every head's weight on key 0 and divides each row by what is left
before the layer's matrix is made, as if parking there moved nothing: R's column 0 is then 0 past row 0, and the
other tokens are ranked by what the heads take from them (docs/heads.md).

Float64; one `[n, n]` product is held, each layer multiplied in as it comes (`Rollout.add`). Where only the last
query's row of R is shown (the terminal), `last_row` takes it alone, `e_last · M_L · ... · M_0` from the last layer
down: a row times a matrix a layer, n² where the whole product is n³ (at 1,228 tokens and 30 layers, 0.1 GFLOP
against 110 GFLOP a rollout); the same numbers up to float64 rounding (the products associate differently).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


def layer_matrix(heads: Tensor, first_row: int = 0) -> Tensor:
    """`0.5 · mean_heads(heads) + 0.5 · I`, rows renormalised, `[n, n]` float64 from `[n_head, n, n]`
    (Abnar & Zuidema's `aug_att_mat = att_mat + residual_att` over its row sums, with the heads averaged).
    `first_row`: `heads` are the rows from that one on (`[n_head, n_rows, n_keys]`, a block of `LastRows`): the
    identity's 1 of row i sits in column first_row + i. Every step is row by row, so a block's rows are the
    whole matrix's."""
    import torch

    M = heads.detach().to(torch.float64).mean(dim=0).mul_(0.5)  # [n, n]
    M.diagonal(first_row).add_(0.5)  # + 0.5 · I, in place: the same numbers as adding the identity, no eye made
    return M.div_(M.sum(dim=-1, keepdim=True))


def row_normalised(weights: Tensor, in_place: bool = False) -> Tensor:
    """Each row divided by its sum (a row of zeros stays zeros): value-weighted patterns as shares. `in_place`:
    `weights` (a tensor of the caller's own) divided where it lies, the same numbers with no new tensor."""
    import torch

    total = weights.sum(dim=-1, keepdim=True)
    divisor = torch.where(total > 0, total, 1.0)
    return weights.div_(divisor) if in_place else weights / divisor


def layer_matrix_of(heads: Tensor, value_norms: Tensor | None = None, drop_first: bool = False) -> Tensor:
    """One layer's `M_l` `[n, n]` from its patterns `[n_head, n, n]`: with `value_norms` `[n_head, n]` the
    value-weighted patterns as shares, with `drop_first` key 0's weight left out (the module's docstring)."""
    from attnscope.readings.moved import weighted

    if value_norms is not None:
        heads = row_normalised(weighted(heads, value_norms), in_place=True)  # [n_head, n, n]
    if drop_first:
        heads = row_normalised(without_first(heads), in_place=True)  # [n_head, n, n]; row 0 zeros: the identity's
    return layer_matrix(heads)  # [n, n]


class Rollout:
    """The product of the layers' matrices, from layer 0 up: `add` each layer's heads in order, `matrix` is R."""

    def __init__(self, drop_first: bool = False) -> None:
        self.matrix: Tensor | None = None
        self.layers = 0
        self.drop_first = drop_first  # the first key's weight left out of every head, rows renormalised

    def add(self, heads: Tensor, value_norms: Tensor | None = None) -> None:
        """The next layer's patterns `[n_head, n, n]` (square: a self-attention over the same tokens); with its
        value_norms `[n_head, n]`, the value-weighted patterns, each row as shares, in their place."""
        from attnscope.tensors.threads import one_thread

        with one_thread():
            M = layer_matrix_of(heads, value_norms, self.drop_first)  # [n, n]
            self.matrix = M if self.matrix is None else M @ self.matrix  # [n, n] @ [n, n] -> [n, n]
        self.layers += 1


def without_first(heads: Tensor) -> Tensor:
    """`[n_head, n, n]` float64 with key 0's column set to 0."""
    import torch

    heads = heads.detach().to(torch.float64).clone()
    heads[..., 0] = 0.0
    return heads


def first_share(matrix: Tensor, row: int = -1) -> float:
    """The first token's share of one row of R (the last query's by default)."""
    return float(matrix[row, 0])


def rollout(layers: list[Tensor], drop_first: bool = False) -> Tensor | None:
    """R over `layers`, each `[n_head, n, n]`, layer 0 first; None where there are none or one is not square.
    `drop_first`: the rollout without the first token (the module's docstring)."""
    chain = Rollout(drop_first)
    for heads in layers:
        if heads.dim() != 3 or heads.shape[-1] != heads.shape[-2]:
            return None
        chain.add(heads)
    return chain.matrix


def last_row(layers: list[Tensor], norms: list[Tensor] | None = None, drop_first: bool = False) -> Tensor | None:
    """The last query's row of R over `layers` (each `[n_head, n, n]`, layer 0 first) as `[1, n]` float64:
    `e_last · M_L · ... · M_0`, the last layer multiplied in first; with `norms` (a layer's `[n_head, n]` each)
    the value-weighted rollout's. None where there are no layers or one is not square (as `rollout`)."""
    rows = last_rows(layers, norms, drop_first)
    return None if rows is None else rows["rollout_weighted" if norms is not None else
                                          "rollout_without_first" if drop_first else "rollout"]


def last_rows(layers: list[Tensor], norms: list[Tensor] | None = None,
              without_first_token: bool = True) -> dict[str, Tensor] | None:
    """`last_row` of the rollout, of the rollout without the first token (`without_first_token`) and, with
    `norms`, of the value-weighted rollout, `{"rollout", "rollout_without_first", "rollout_weighted"}`, each
    `[1, n]`: the three chains in one pass over the layers, each layer's patterns made float64 once for all
    three (the same numbers as three `last_row` calls). None where `last_row` is None."""
    import torch

    from attnscope.tensors.threads import one_thread

    if not layers or any(A.dim() != 3 or A.shape[-1] != A.shape[-2] for A in layers):
        return None
    n = layers[0].shape[-1]
    start = torch.zeros(1, n, dtype=torch.float64)
    start[0, -1] = 1.0
    rows = {"rollout": start} | ({"rollout_without_first": start} if without_first_token else {}) | (
        {"rollout_weighted": start} if norms is not None else {})
    with one_thread():
        for index in reversed(range(len(layers))):
            A = layers[index].detach().to(torch.float64)  # [n_head, n, n], once for the chains
            rows["rollout"] = rows["rollout"] @ layer_matrix(A)  # [1, n] @ [n, n] -> [1, n]
            if without_first_token:
                dropped = row_normalised(without_first(A), in_place=True)  # [n_head, n, n]
                rows["rollout_without_first"] = rows["rollout_without_first"] @ layer_matrix(dropped)
                del dropped
            if norms is not None:
                shares = row_normalised(A * norms[index][:, None, :], in_place=True)  # moved.weighted, as shares
                rows["rollout_weighted"] = rows["rollout_weighted"] @ layer_matrix(shares)
                del shares
    return rows


CHAINS = ("rollout", "rollout_without_first", "rollout_weighted")


class LastRows:
    """`last_rows` for layers that come one at a time and are not kept (models/forward/stream.py's every layer
    on a long text): each layer's matrices `M_l` (one a chain) are given in blocks of rows as the layer's
    patterns are read (`put`), and kept in float32, a causal layer's lower triangle only (row i's keys 0..i,
    packed: n(n + 1)/2 numbers); `rows` then takes `e_last · M_L · ... · M_0` in float64 as `last_rows` does.
    At 1,230 tokens and 30 layers, three chains keep 272 MiB where float64 would keep 545 MiB and the layers'
    patterns 1.6 GiB; float32's rounding (6e-8 of each entry) moves the rows by about 1e-6 at most, below the
    two decimals the terminal prints (docs/performance.md). A chain's packed layers are one tensor
    `[n_layer, n(n + 1)/2]`, its pages written as the layers come and given back whole when it goes."""

    def __init__(self, n: int, n_layer: int, chains: tuple[str, ...] = CHAINS) -> None:
        import torch

        self.n = n
        self.packed = {chain: torch.empty(n_layer, n * (n + 1) // 2, dtype=torch.float32) for chain in chains}
        self.full: dict[tuple[str, int], Tensor] = {}  # a layer that is not causal: its whole [n, n]
        self.causal: list[bool] = []  # each layer's: lower triangular (packed)
        self.lower = torch.ones(n, n, dtype=torch.bool).tril()  # [n, n]: the packed entries, row-major
        self.cells: dict[tuple[int, int], Tensor] = {}  # a block's packed entries in its [n_rows, last]: `_cells`

    def start(self, causal: bool) -> None:
        """A new layer; `causal`: its matrices are lower triangular (no query sees a later key)."""
        import torch

        self.causal.append(causal)
        if not causal:
            for chain in self.packed:
                self.full[chain, len(self.causal) - 1] = torch.zeros(self.n, self.n, dtype=torch.float32)

    def put(self, chain: str, first_row: int, block: Tensor) -> None:
        """Rows first_row.. of the newest layer's M for `chain`, `[n_rows, n_keys]` float64: a causal layer's
        keys 0..first_row + n_rows - 1 (at least), any other's all n."""
        layer, rows = len(self.causal) - 1, block.shape[0]
        if not self.causal[-1]:
            self.full[chain, layer][first_row: first_row + rows] = block
            return
        last = first_row + rows
        start = first_row * (first_row + 1) // 2  # the packed rows before: 1 + 2 + ... + first_row numbers
        count = last * (last + 1) // 2 - start
        cells = self._cells(first_row, last)  # [count]
        self.packed[chain][layer, start: start + count] = block[:, :last].reshape(-1).index_select(0, cells)

    def _cells(self, first_row: int, last: int) -> Tensor:
        """The lower triangle's cells of rows first_row..last - 1 in their `[n_rows, last]` block, flat, in packed
        order, `[count]` long: made once a block (the layers' blocks are the same), where a boolean mask was
        read again at each put (5 times as long)."""

        key = (first_row, last)
        if key not in self.cells:
            self.cells[key] = self.lower[first_row:last, :last].reshape(-1).nonzero().squeeze(1)
        return self.cells[key]

    def matrix(self, chain: str, layer: int) -> Tensor:
        """Layer `layer`'s M for `chain`, `[n, n]` float64."""
        import torch

        if not self.causal[layer]:
            return self.full[chain, layer].to(torch.float64)
        return torch.zeros(self.n, self.n, dtype=torch.float64).masked_scatter_(
            self.lower, self.packed[chain][layer].to(torch.float64))

    def rows(self) -> dict[str, Tensor]:
        """Each chain's last row of R, `[1, n]` float64 (`last_rows`' keys). Of the last layer only its last row
        is read (the rest need not be given)."""
        import torch

        from attnscope.tensors.threads import one_thread

        out = {}
        top = len(self.causal) - 1
        with one_thread():
            for chain in self.packed:
                # e_last · M_top: the top layer's last row (the only one given of it: EveryLayer), [1, n]
                last = self.packed[chain][top, -self.n:] if self.causal[top] else self.full[chain, top][-1]
                row = last.to(torch.float64)[None]
                for index in reversed(range(top)):
                    row = row @ self.matrix(chain, index)  # [1, n] @ [n, n] -> [1, n]
                out[chain] = row
        return out
