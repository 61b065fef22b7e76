"""Ops of the code's own on its merged heads before the output projection: BitNet's `attn_sub_norm` (an RMSNorm over
the merged heads), LeViT's `projection(activation(x))` (a Hardswish), any function of the merged heads alone.

Read off the data flow: the output projection (the first Linear after the attention's `attn @ v` that reads it)
reads a tensor made from the merge of the heads (the first tensor of the projection's input width the code makes
from `attn @ v`, by rearranging alone) through ops that change values, and nothing else of the forward's inputs:
no other projection (an output gate is outgate.py's), no input tensor (a residual). No reference holds such ops, so
the reference's output projection is the identity and it is compared up to the merge of the heads, as for a module
without an output projection (reference.merge_only): the steps up to the merge are compared, and a mistake there
is named by experiment as in any other code.
"""

from __future__ import annotations

import inspect
from typing import Any

from attnscope.usertrace.align import REARRANGING, ancestors
from attnscope.usertrace.record import Record

RANDOM = ("dropout", "rand", "bernoulli", "multinomial")
CASTS = ("to", "type_as", "float", "double", "half", "bfloat16", "clone", "detach")
MOVES = ("split", "chunk", "unbind", "tensor_split", "cat", "concat", "concatenate", "stack")


def found(module: Any, records: list[Record], o_width: tuple[int, int],
          held: frozenset[int] = frozenset()) -> str | None:
    """The note that says the code's own ops between its merged heads and its output projection (whose weight is
    `o_width` = (in_features, out_features)); None where the projection reads the merge as it is, or reads
    anything else of the inputs. `held`: records before the merge that the reference computes too (the add of the
    code's own term on its attention's output, the Set Transformer's `Q_ + A·V_`), no op of the code's own there."""
    from attnscope.usertrace.flow import operands

    ops = operands(records)
    if ops is None or ops[3] is None:
        return None
    av = ops[3]
    below = {r.index for r in records if r.index > av and av in ancestors(r, records)}
    out = next((r for r in records if r.index in below and r.style == "linear"), None)
    if out is None or out.tensor.shape[-1] != o_width[1]:
        return None
    given = [i for i in out.parents if i in below or i == av]
    if len(given) != 1 or records[given[0]].tensor.shape[-1] != o_width[0]:
        return None
    path = (ancestors(records[given[0]], records) | {given[0]}) & below
    merged = next((r for r in records if r.index in path and r.tensor.shape[-1] == o_width[0]), None)
    if merged is None:
        return None
    before = [records[i] for i in sorted(path) if i <= merged.index]
    after = [records[i] for i in sorted(path) if i > merged.index]
    changing = [r for r in after if r.func not in REARRANGING + CASTS]
    # the heads taken out of the batch and joined along the features (`cat(o.split(n_batch, 0), -1)`) move values
    # alone where every value of attn @ v reaches the merge
    moved = [r for r in before if r.func not in REARRANGING + CASTS and r.index not in held]
    if any(not _moved(r, path | {av}) for r in moved) or not changing or (
            moved and merged.tensor.numel() != records[av].tensor.numel()):
        return None
    inputs = _forward_names(module)
    for r in after:
        if _reads_input(r, inputs):
            return None
        for p in r.parents:
            if p not in path and p != merged.index and any(
                    records[a].style == "linear" or _reads_input(records[a], inputs) or a == av or a in below
                    for a in ancestors(records[p], records) | {p}):
                return None  # a gate from a projection, a residual, the attention again: not the merge's alone
    lines = sorted({r.line for r in changing})
    funcs = ", ".join(dict.fromkeys(r.func for r in changing))
    where = f"line {lines[0]}" if len(lines) == 1 else f"lines {', '.join(map(str, lines))}"
    return (f"your code applies ops of its own to its merged heads before its output projection ({where}: {funcs}; "
            f"the projection at line {out.line} reads their result, made from the merge alone), as BitNet's sub-norm "
            "and LeViT's activation do: no reference holds them, so its output projection is the identity and it is "
            "compared up to the merge of the heads; a convention, not a mistake")


def _moved(record: Record, path: set[int]) -> bool:
    """Whether the op only moves values the path already holds: the heads taken out of the batch by `split` (or
    `chunk`, `unbind`) and joined along the features by `cat` (or `stack`), every part from the path."""
    return record.func in MOVES and bool(record.parents) and all(p in path for p in record.parents)


def _forward_names(module: Any) -> set[str]:
    try:
        return {n for n in inspect.signature(module.forward).parameters if n != "self"}
    except (TypeError, ValueError, AttributeError):
        return set()


def _reads_input(record: Record, names: set[str]) -> bool:
    """Whether the op reads one of the forward's own arguments by name (an input tensor, not a record)."""
    return any(kind == "text" and value in names for kind, value in record.args)


def merged(found: Any, note: str) -> Any:
    """`found` (reference.Projections) with an identity output projection over the merged heads' width (the width
    the code's own projection reads: n_head·d_V, whatever d_V is), so that the reference is compared up to the
    merge."""
    import torch

    from attnscope.usertrace import fused
    from attnscope.usertrace.reference import Projections

    _, o = found.linears["o"]
    weight = o.weight
    eye = fused.Part(fused.NONE, torch.eye(o.in_features, dtype=weight.dtype, device=weight.device), None)
    return Projections({**found.linears, "o": (fused.NONE, eye)}, f"{found.matched_by}; {note}", found.note, True)


def head_factor(module: Any, records: list[Record], lined: Any) -> Any:
    """Ops of the code's own on each head's output before the heads merge (a norm of each head's `attn @ v`, a gain
    on it), read from the merge alone as `found` reads them after it: their result divided by their input, as the
    run computes them, in the reference's x_raw layout, as an output gate (outgate.OutGate) the reference multiplies
    its heads' output by before the merge. Exact where the reference's x_raw is the code's `attn @ v`, and where a
    mistake upstream is rerun it gives the code's tensors back only where that rerun gives back its `attn @ v`, so
    nothing is explained away; the output projection is still compared. None where there are none."""
    import torch

    from attnscope.usertrace.flow import operands
    from attnscope.usertrace.outgate import OutGate, _layout_of

    trace = lined.trace
    if lined.divergence is None or lined.divergence.experiment is not None:
        return None  # a mistake named by experiment (a dropout left on the heads' output) stays named
    ops = operands(records)
    if trace is None or ops is None or ops[3] is None or "x_raw" not in trace or trace["x_raw"].dim() != 4:
        return None
    av, shape = ops[3], tuple(trace["x_raw"].shape)
    below = {r.index for r in records if r.index > av and av in ancestors(r, records)}
    out = next((r for r in records if r.index in below and r.style == "linear"), None)
    if out is None:
        return None
    given = [i for i in out.parents if i in below or i == av]
    if len(given) != 1:
        return None
    path = sorted((ancestors(records[given[0]], records) | {given[0]}) & below)
    changing = [records[i] for i in path if records[i].func not in REARRANGING + CASTS]
    if not changing or changing[-1].tensor.numel() != records[av].tensor.numel() or any(
            word in records[a].func for r in changing for a in ancestors(r, records) | {r.index}
            for word in RANDOM):
        return None  # a dropout, by F.dropout or by hand: drawn at random, no op of the model's
    first, last = changing[0], changing[-1]
    width = records[given[0]].tensor.shape[-1]
    merged = next((records[i] for i in path if records[i].tensor.shape[-1] == width), None)
    if merged is None or last.index >= merged.index:  # ops on the merged heads: `found`'s
        return None
    start = next((p for p in first.parents if p == av or p in path), None)
    if start is None or tuple(records[start].tensor.shape) != tuple(last.tensor.shape) or any(
            records[i].func not in REARRANGING + CASTS for i in path if i > last.index):
        return None
    inputs = _forward_names(module)
    for r in (records[i] for i in path if first.index <= i <= last.index):
        if _reads_input(r, inputs) or any(p not in path and p != av and p != start and any(
                records[a].style == "linear" or _reads_input(records[a], inputs) or a == av or a in below
                for a in ancestors(records[p], records) | {p}) for p in r.parents):
            return None
    made = records[av].tensor.double()  # attn @ v as the code makes it, laid out as x_raw where its shape is
    layout = _layout_of(records[start], made if tuple(made.shape) == shape else None, shape)
    if layout is None or not layout.same and tuple(records[start].tensor.shape) == shape and layout.order != tuple(
            range(4)):
        return None
    before = records[start].tensor.double()
    if bool((before == 0).any()):
        return None
    factor = layout.undo(last.tensor.double() / before, shape)
    if not bool(torch.isfinite(factor).all()):
        return None
    lines = sorted({r.line for r in changing})
    funcs = ", ".join(dict.fromkeys(r.func for r in changing))
    where = f"line {lines[0]}" if len(lines) == 1 else f"lines {', '.join(map(str, lines))}"
    note = (f"your code applies ops of its own to each head's output before the heads merge ({where}: {funcs}; "
            "made from attn @ v alone, as a sub-norm of each head is): the reference multiplies its heads' output by "
            "what they multiply yours by, as your run computes it, before the merge and the output projection; a "
            "convention, not a mistake")
    return OutGate(factor.float(), True, note)
