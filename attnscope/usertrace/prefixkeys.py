"""Keys and values projected part by part and joined after their projection, the queries' own tokens among the parts
(lucidrains' Perceiver AR: `k = torch.cat((to_kv(context)[0], to_kv(x)[0]), dim=1)`, the prefix then the tokens the
queries come from; a join of the split heads along their token axis alike). A projection reads each token alone, so
the joined keys are the projection of the joined inputs: the reference's key and value input is the parts' inputs
joined in the code's order, n_K its length, and a causal rule aligns over those joined keys.

Read from the data flow, never from names: the scores' key (value) operand comes from a join whose every part is the
output of one projection (the same layer or weight for all the parts), one of them reading the tensor the query
projection reads and another reading the forward's other input. Queries.input_keys reads the join before the
projection (Idefics2's); this reads it after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnscope.usertrace.cutnames import layer_of

if TYPE_CHECKING:
    import torch

    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.record import Record


@dataclass
class Joined:
    tensors: dict[str, torch.Tensor]  # K, V: the parts' inputs joined along the tokens, [n_batch, n_K, d]
    parts: list[tuple[int, int, bool]]  # (first key, length, the queries' own tokens), in the join's order
    line: int  # the keys' join
    projections: dict[str, str]  # K, V: the layer every part of the role goes through


def find(records: list[Record], inputs: Inputs) -> Joined | None:
    """The keys' and values' input where each is joined after its projection (module docstring); None otherwise."""
    from attnscope.usertrace.queries import query_projection

    if inputs.layout != "row" or inputs.cache is not None or len(inputs.tensors) < 2 \
            or inputs.own and inputs.own_from != "norm":
        return None
    projected = query_projection(records)
    if projected is None:
        return None
    found, q_proj = projected
    queried = q_proj.args[1]
    joined: Joined | None = None
    for role, index in (("K", found[1]), ("V", found[2])):
        read = _joined(records, index, (queried, _texts(records, ("rec", found[0]))), inputs.tensors)
        if read is None or joined is not None and read[1] != joined.parts:
            return None
        tensor, parts, line, projection = read
        if joined is None:
            joined = Joined({}, parts, line, {})
        joined.tensors[role], joined.projections[role] = tensor, projection
    return joined


def _joined(records: list[Record], index: int, queries: tuple[tuple[str, Any], set[str]],
            names: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int, bool]], int, str] | None:
    """(the inputs joined, the parts, the join's line, the projection) of the join nearest above record `index`
    whose every part is one projection's output and reads a [n_batch, n, d] tensor, the queries' among them
    (`queries`: what their projection reads, and the names their operand reads) and another of the forward's inputs,
    one the queries never read (joint attention joins its queries too)."""
    import torch

    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.flow import projection_above
    from attnscope.usertrace.joint import JOINS

    queried, read_by_queries = queries
    above = sorted(ancestors(records[index], records) | {index}, reverse=True)
    for join in (records[i] for i in above if records[i].func.split(".")[-1] in JOINS):
        listed: list[tuple[str, Any]] = next((value for kind, value in join.args if kind == "list"), [])
        if len(listed) < 2 or any(kind != "rec" for kind, _ in listed):
            continue
        axis = _axis(join.tensor, [records[value].tensor for _, value in listed])
        if axis is None:
            continue
        projections = [projection_above(records, value) for _, value in listed]
        if any(p is None or p.args[0][0] != "text" for p in projections):
            continue
        names_of = {layer_of(str(p.args[0][1])) for p in projections if p is not None}
        reads = [p.args[1] for p in projections if p is not None]
        tensors = [_tensor(records, arg, names) for arg in reads]
        if len(names_of) != 1 or queried not in reads or any(t is None or t.dim() != 3 for t in tensors):
            continue
        held = [t for t in tensors if t is not None]
        lengths = [int(t.shape[1]) for t in held]
        if any(int(records[value].tensor.shape[axis]) != n for (_, value), n in zip(listed, lengths, strict=True)) \
                or len({(t.shape[0], t.shape[2]) for t in held}) != 1:
            continue
        others = {text for arg in reads if arg != queried for text in _texts(records, arg)}
        if not others & set(names) - read_by_queries:
            continue  # the other parts read none of the forward's inputs the queries do not read
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        parts = [(s, n, arg == queried) for s, n, arg in zip(starts, lengths, reads, strict=True)]
        return torch.cat([t.detach() for t in held], dim=1), parts, join.line, names_of.pop()
    return None


def _axis(joined: torch.Tensor, parts: list[torch.Tensor]) -> int | None:
    """The axis `parts` were joined along into `joined` (their sizes sum to its, every other axis alike)."""
    if any(p.dim() != joined.dim() for p in parts):
        return None
    for axis in range(joined.dim()):
        others = [a for a in range(joined.dim()) if a != axis]
        if sum(int(p.shape[axis]) for p in parts) == joined.shape[axis] \
                and all(p.shape[a] == joined.shape[a] for p in parts for a in others):
            return axis
    return None


def _tensor(records: list[Record], arg: tuple[str, Any], inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """What a projection reads: a record's tensor, or the forward's input it names."""
    return records[arg[1]].tensor if arg[0] == "rec" else inputs.get(str(arg[1])) if arg[0] == "text" else None


def _texts(records: list[Record], arg: tuple[str, Any]) -> set[str]:
    """The names (inputs, parameters) `arg` reads, itself or in its history."""
    from attnscope.usertrace.queries import _texts as texts

    return texts(records, [arg])


def apply(inputs: Inputs, joined: Joined) -> bool:
    """`inputs` with the joined tensors as the reference's key and value inputs, n_K their length, a key padding of
    the other input's keys laid over the joined keys (the queries' own tokens may be attended), and the note; False
    (nothing changed) where the mask fits neither."""
    import torch

    n_K = int(joined.tensors["K"].shape[1])
    mask = inputs.mask
    if mask is not None and mask.dim() >= 1 and mask.shape[-1] not in (1, n_K):
        part = [(s, n) for s, n, own in joined.parts if not own and n == mask.shape[-1]]
        if len(part) != 1:
            return False
        start, n = part[0]
        wide = torch.ones if mask.dtype == torch.bool else torch.zeros
        laid = wide(*mask.shape[:-1], n_K, dtype=mask.dtype, device=mask.device)
        laid[..., start:start + n] = mask
        inputs.mask = laid
    n_input = inputs.sizes.get("n_K")
    inputs.own = {**{role: t for role, t in inputs.own.items() if role == "Q"}, **joined.tensors}
    inputs.own_from = "keys"
    inputs.sizes["n_K"] = n_K
    first = next(s for s, _, own in joined.parts if own)
    where = "after" if first else "before"
    by = " and ".join(dict.fromkeys(joined.projections.values()))
    inputs.notes.append(f"your keys and values are projected part by part by {by} and joined after "
                        f"it (line {joined.line}), the tokens your queries read among them ({where} the others): "
                        f"n_K = {n_K} where your keys' input has {n_input}; a convention (a prefix the queries' own "
                        "tokens join, Perceiver AR's), not a mistake: the reference's key and value projections read "
                        "the parts' inputs joined in the same order, a causal rule aligned over the joined keys")
    return True
