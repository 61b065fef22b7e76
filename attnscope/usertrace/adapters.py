"""A low-rank adapter the code adds to a projection's output (LoRA's `q_proj(x) + B(A(x))`, Zamba2-1.2B's shared
block with `linear_q_adapter_list[i]`, an `nn.Sequential` of two Linear layers): read from the data flow, where a
projection's output is added to the last of a chain of Linear layers that reads the projection's own input, that
chain is part of the projection. The reference holds the sum as one weight, `W + W_B·W_A` (and the biases the
chain carries), so its projected q, k, v are the code's after the add; the adapter's layers are no projection of
their own. Only Linear layers (no nonlinearity between them, no scale of the code's own) are folded so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record

ADDS = ("add", "__add__", "__radd__")


def fold(linears: list[tuple[str, Any]], records: list[Record]) -> list[tuple[str, Any]]:
    """`linears` with each projection that has an adapter added to its output held with the adapter folded in
    (fused.Part), the adapter's own layers left out; `linears` as they are where none has."""
    held = dict(linears)
    folded: dict[str, Any] = {}
    used: set[str] = set()
    for name, linear in linears:
        if name in used:
            continue
        found = _adapter(name, linear, records, held)
        if found is not None:
            folded[name], chain = found
            used |= set(chain[0])
    if not folded:
        return linears
    return [(name, folded.get(name, linear)) for name, linear in linears if name not in used]


def _made_by(records: list[Record], name: str) -> list[Record]:
    return [r for r in records if r.style == "linear" and len(r.args) > 1 and r.args[0] == ("text", name)]


def _adapter(name: str, linear: Any, records: list[Record],
             held: dict[str, Any]) -> tuple[Any, tuple[list[str], float]] | None:
    """The projection `name` held with its adapter folded in, and the adapter's chain; None where some call of it
    has no adapter added, or calls differ in theirs (a projection called twice, each call with its adapter called
    again: Zamba2's keys' projection and adapter, called for the keys and, in code that copied a line, the values)."""
    from attnscope.usertrace.fused import Part

    made = _made_by(records, name)
    weight = getattr(linear, "weight", None)
    if not made or not isinstance(weight, torch.Tensor):
        return None
    chains = [_added(projection, records, held, name, len(made)) for projection in made]
    chain = chains[0]
    if chain is None or any(c != chain for c in chains[1:]):
        return None
    names, factor = chain
    total, bias = _product([held[n] for n in names])
    total, bias = total * factor, bias * factor
    if total.shape != weight.shape:
        return None
    own = getattr(linear, "bias", None)
    summed = bias if own is None else bias + own.detach()
    return Part(name, weight.detach() + total.to(weight.dtype), summed.to(weight.dtype)), chain


def _added(projection: Record, records: list[Record], held: dict[str, Any], name: str,
           calls: int) -> tuple[list[str], float] | None:
    """The chain of Linear layers whose output the code adds to this call of the projection (_chain)."""
    for record in records[projection.index + 1:]:
        if record.func not in ADDS or len(record.args) != 2 or ("rec", projection.index) not in record.args:
            continue
        other = [v for k, v in record.args if k == "rec" and v != projection.index]
        if len(other) != 1 or tuple(records[other[0]].tensor.shape) != tuple(projection.tensor.shape):
            continue
        chain = _chain(records, other[0], projection.args[1], held, name, calls)
        if chain is not None:
            return chain
    return None


def _chain(records: list[Record], index: int, source: tuple[str, Any], held: dict[str, Any],
           name: str, calls: int = 1) -> tuple[list[str], float] | None:
    """The names of the Linear layers that made records[index] from `source`, one after another, first applied
    first, and the number the code scales their product by (peft's `lora_B(lora_A(dropout(x))) * scaling`); a
    dropout that changed nothing (eval mode) is passed through. None where anything else lies between, or a layer
    runs another number of times than the projection (`calls`)."""
    chain: list[str] = []
    factor = 1.0
    while True:
        record = records[index]
        numbers = [v for k, v in record.args if k == "text" and _number(v) is not None]
        parents = [v for k, v in record.args if k == "rec"]
        if record.func in SCALES and len(parents) == 1 and len(numbers) == 1 and len(record.args) == 2:
            factor *= _number(numbers[0]) or 1.0  # type: ignore[operator]
            index = parents[0]
            continue
        if "dropout" in record.func and parents and record.details.get("same") == "returns its input":
            index = parents[0]
            continue
        if record.style != "linear" or len(record.args) < 2 or record.args[0][0] != "text":
            return None
        layer = record.args[0][1]
        if layer not in held or layer == name or layer in chain or len(_made_by(records, layer)) != calls:
            return None
        chain.append(layer)
        if record.args[1] == source or _unchanged(records, record.args[1], source):
            return (chain[::-1], factor) if len(chain) > 1 else None  # a low-rank pair (or more), never one alone
        kind, value = record.args[1]
        if kind != "rec":
            return None
        index = value


SCALES = ("mul", "__mul__", "__rmul__")


def _number(text: Any) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _unchanged(records: list[Record], read: tuple[str, Any], source: tuple[str, Any]) -> bool:
    """Whether `read` is `source` handed back by a dropout that changed nothing (eval mode: the very tensor)."""
    if read[0] != "rec":
        return False
    record = records[read[1]]
    return "dropout" in record.func and bool(record.args) and record.args[0] == source \
        and record.details.get("same") == "returns its input"


def _product(layers: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and bias of the layers applied one after another: W_k···W_1 and its bias."""
    first = layers[0].weight.detach().double()
    total = first
    bias = layers[0].bias.detach().double() if layers[0].bias is not None else torch.zeros(first.shape[0],
                                                                                          dtype=torch.float64)
    for layer in layers[1:]:
        w = layer.weight.detach().double()
        total = w @ total
        bias = w @ bias + (layer.bias.detach().double() if layer.bias is not None else 0)
    return total, bias
