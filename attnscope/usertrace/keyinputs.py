"""Keys and values read from a tensor the module computes from its input: Segformer's and PVT's spatial reduction
(`sr = Conv2d(stride=sr_ratio)` over x laid out as an image, then a LayerNorm), a pooled memory
(`F.adaptive_avg_pool1d(x.transpose(1, 2), m)`), a downsampled sequence. The forward takes x, its query projection
reads x, but its key and value projections read one other tensor made from x, so n_K is that tensor's length.

Read from the run, never from names or widths: the projections behind the scores' right operand and the pattern's
partner (flow.operands) read one and the same tensor, made from the forward's input by ops of no projection, where
the query projection reads the input itself. That tensor is the keys' and values' input side, a convention, not
attention: the reference's key and value projections read it (`Inputs.own`, as queries.py's latents), n_K its
length, and a mistake after the projections is still named by experiment. The tensor is kept only where the
module's own parameters made it (a convolution, a norm) or, of another length than the input, an op that summarizes
positions (a pooling, a mean, an interpolation): the input merely laid out anew for the keys (a transpose that
scrambles the tokens) or cut (`x[:, :-1]`) is a mistake the line-up shows, no convention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.record import Record


@dataclass(frozen=True)
class KeyInput:
    tensor: torch.Tensor  # [n_batch, n_K, d_feat], as the key and value projections read it
    record: Record  # the op that made it
    projections: tuple[str, ...]  # the key's and the value's projection (one, fused or read twice)


def find(records: list[Record], inputs: Inputs, module: Any) -> KeyInput | None:
    """The tensor the key and value projections read, where the module makes it from its one input and the query
    projection reads that input; None otherwise."""
    from attnscope.usertrace.flow import operands

    if module is None or inputs.own or inputs.layout != "row" or inputs.cache is not None \
            or set(inputs.roles.values()) != {"Q"} or len(inputs.roles) != 1:
        return None
    given = next(iter(inputs.roles))
    found = operands(records)
    if found is None:
        return None
    reads = [_projected(records, index) for index in found[:3]]
    if any(r is None for r in reads):
        return None
    (q_call, q_in), (k_call, k_in), (v_call, v_in) = reads  # type: ignore[misc]
    if q_in != ("text", given) or k_in[0] != "rec" or v_in[0] != "rec":
        return None
    keys, values = records[k_in[1]], records[v_in[1]]
    if keys.index != values.index and not _same(keys.tensor, values.tensor):
        return None
    x = inputs.tensors[given]
    texts, parameters = _history(keys, records, module)
    if texts & set(inputs.tensors) != {given} or not _batched(keys.tensor, x):
        return None
    if not parameters and (keys.tensor.shape[-2] == x.shape[-2] or not _pooled(keys, records)):
        return None  # made by no weight of the module's and no pooling: x laid out anew or cut, no input side
    calls = tuple(dict.fromkeys(str(records[c].args[0][1]) for c in (k_call, v_call)))
    return KeyInput(keys.tensor.detach(), keys, calls)


def apply(inputs: Inputs, found: KeyInput) -> bool:
    """`inputs` with the tensor as the reference's key and value input, n_K its length, and the note that says so;
    False (nothing changed) where the reference's mask does not fit that length."""
    n_K = int(found.tensor.shape[-2])
    mask = inputs.mask
    if mask is not None and mask.dim() >= 1 and mask.shape[-1] not in (1, n_K):
        return False
    inputs.own = {"K": found.tensor, "V": found.tensor}
    inputs.own_from = "keys"
    n_input = inputs.sizes.get("n_K")
    inputs.sizes["n_K"] = n_K
    by = " and ".join(found.projections)
    op = found.record.details.get("op", found.record.call)
    inputs.notes.append(f"your key and value projections ({by}) read a tensor your module makes from its input "
                        f"(line {found.record.line}: {op}), n_K = {n_K} where the input has {n_input}: read as the "
                        "keys' and values' input side (a spatial reduction, a pooling, a memory of its own), a "
                        "convention, not a mistake: the reference's key and value projections read the same tensor")
    return True


def _projected(records: list[Record], index: int) -> tuple[int, tuple[str, Any]] | None:
    """The projection nearest above record `index` (a Linear's call, `x @ W`) and what it reads: ("text", the
    input's name) or ("rec", a record); None where none is seen."""
    from attnscope.usertrace.flow import projection_above

    call = projection_above(records, index)
    if call is None or call.args[0][0] != "text":
        return None
    return call.index, call.args[1]


def _history(record: Record, records: list[Record], module: Any) -> tuple[set[str], set[str]]:
    """The names the ops that made `record` read (inputs, parameters), and the module's parameters among them;
    a projection's call on the way makes it no input side (empty)."""
    from attnscope.usertrace.align import ancestors

    history = [records[i] for i in ancestors(record, records) | {record.index}]
    if any(r.style == "linear" for r in history):
        return set(), set()
    texts = set()
    for r in history:
        for kind, value in r.args:
            if kind == "kw":
                kind, value = value[1]
            if kind == "text" and isinstance(value, str):
                texts.add(value)
    held = {name for name, _ in (*module.named_parameters(), *module.named_buffers())}
    return texts, texts & held


POOLING = ("pool", "interpolate", "mean", "conv", "sum")  # ops that summarize positions (a pooled memory)


def _pooled(record: Record, records: list[Record]) -> bool:
    """Whether an op that summarizes positions (a pooling, a mean, an interpolation) made `record`."""
    from attnscope.usertrace.align import ancestors

    return any(any(word in records[i].func for word in POOLING) for i in ancestors(record, records) | {record.index})


def _batched(tensor: torch.Tensor, x: torch.Tensor) -> bool:
    """`tensor` is laid out as the input is, `[n_batch, n, d_feat]`, its own length n."""
    return tensor.is_floating_point() and tensor.dim() == x.dim() == 3 and tensor.shape[0] == x.shape[0] \
        and tensor.shape[-1] == x.shape[-1]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))
