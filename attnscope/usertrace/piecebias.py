"""A position bias the module makes itself and adds to its scores in pieces: neighbourhood attention (NAT, Dinat:
NATTEN's `natten2dqkrpb`) gathers each query's keys, `[n_batch, n_head, n_Q, k·k]`, and adds the bias its `rpb`
table gives each (query, neighbour) cell, laid out the same way. No tensor of the code holds the bias as
`[.., n_Q, n_K]` (ownbias.py's reading); the pieces of the scores (gathered.py) say which cell of the reference's
scores each of the piece's cells is, so the bias is scattered there. The cells no piece holds are those the code
never scores (outside each query's neighbourhood): the reference's mask (--mask) leaves them out, and their bias is 0.

The bias is read where the code adds it to a piece (or to what it made from one elementwise, its softmax included:
a bias added after the softmax is then t5.after_softmax by experiment), from a tensor of the module's parameters
that the inputs do not flow into. A table indexed with the other sign of the offset (the key's position minus the
query's, or the query's minus the key's) is a convention of the table, not a mistake: Swin indexes by the query's
minus the key's, NAT by the key's minus the query's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace.ownbias import ADDS, computed_from, params_of
from attnscope.usertrace.scorepieces import KEYS

VALUES = ("V_split", "V_rep")

if TYPE_CHECKING:
    from attnscope.trace import Trace
    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.record import Record


def piece_bias(module: Any, records: list[Record], inputs: Inputs, trace: Trace | None
               ) -> tuple[torch.Tensor, str] | None:
    """The bias the code adds to its pieces of the scores, as the reference's `[n_batch, n_head, n_Q, n_K]` (0 in
    the cells no piece holds), and a note; None where it adds none, more than one, or its pieces cover no scores."""
    from attnscope.usertrace import gathered

    if trace is None or "scores" not in trace or not isinstance(module, torch.nn.Module):
        return None
    learned = {name for name, _ in module.named_parameters()}
    if not learned:
        return None
    # the pieces' cells; where the code scores its queries against its values (k and v swapped, the keys taken from
    # the values), the values' rows place them as well: a cell is a query's and a token's
    pieces = gathered.score_pieces(trace, records) or gathered.score_pieces(trace, records, (*KEYS, *VALUES))
    if not pieces:
        return None
    shape = tuple(trace["scores"].shape)
    fed = computed_from(records, set(inputs.tensors))
    from_params = computed_from(records, learned | {n.rsplit(".", 1)[0] for n in learned})
    dense = torch.zeros(math.prod(shape), dtype=torch.float64)
    found: set[int] = set()
    for piece, index in pieces:
        for held, cells in _held(piece, index, records).items():
            bias = _added(records[held], records, cells, fed, from_params)
            if bias is None:
                continue
            at, laid = bias
            dense[cells.reshape(-1)] = laid.reshape(-1)
            found.add(at)
    if len(found) != 1:
        return None
    made = records[found.pop()]
    out = dense.reshape(shape)
    if bool((out == 0).all()):
        return None
    source = sorted(params_of(made, records, learned))
    said = (f"your code adds a position bias of its own to its scores in pieces (line {made.line}: "
            f"{made.label}, {list(made.tensor.shape)}, from {', '.join(source)}): the "
            f"reference adds it at the cells of {list(shape)} your pieces stand for, 0 in those no piece scores "
            "(--position-bias FILE gives the reference another)")
    return out.float(), said


def _held(piece: Record, index: torch.Tensor, records: list[Record]) -> dict[int, torch.Tensor]:
    """Each tensor that holds the piece's cells, value by value or viewed, with each cell's flat position in the
    scores: from the product the piece comes from (a view of it, or what was added to it, may be the piece the
    softmax reads) to what the code makes of it."""
    from attnscope.usertrace.scorepieces import VIEWS, is_product

    start, cells = piece, index
    while not is_product(start):  # back to the product: through views, and adds of one operand of its size
        same = [records[p] for p in start.parents if records[p].tensor.numel() == start.tensor.numel()
                and records[p].tensor.is_floating_point()]
        if len(same) != 1 or start.func.split(".")[-1] not in (*VIEWS, *ADDS):
            break
        start, cells = same[0], cells.reshape(same[0].tensor.shape)
    held = {start.index: cells}
    for later in records[start.index + 1:]:
        parents = [p for p in later.parents if p in held]
        if len(parents) != 1 or later.tensor.numel() != cells.numel():
            continue
        mine = held[parents[0]]
        if tuple(later.tensor.shape) == tuple(mine.shape):
            held[later.index] = mine
        elif later.func.split(".")[-1] in VIEWS:
            held[later.index] = mine.reshape(later.tensor.shape)
    return held


def _added(record: Record, records: list[Record], cells: torch.Tensor, fed: set[int], from_params: set[int]
           ) -> tuple[int, torch.Tensor] | None:
    """Where `record` adds a tensor of the module's parameters (no input flows into it) to one holding the piece's
    `cells`: (that tensor's record, its values laid out as the cells); None otherwise."""
    if record.func.split(".")[-1] not in ADDS or tuple(record.tensor.shape) != tuple(cells.shape):
        return None
    for p in record.parents:
        bias = records[p].tensor
        if p in fed or p not in from_params or not bias.is_floating_point():
            continue
        try:
            return p, bias.detach().double().expand(cells.shape)
        except RuntimeError:
            continue
    return None

