"""A position bias the module computes itself: T5's `compute_bias` (a learned `relative_attention_bias` embedding
looked up by bucketed relative positions), BEiT's and Swin's `relative_position_bias_table` indexed by position.

Such a bias is the module's own: it depends on the positions and a learned parameter, never on the inputs, and
trace cannot draw it (a `--position-bias` file would have to hold the module's learned numbers). Where the line-up
diverges without it, the reference is run again adding it (lineup.line_up keeps that run where it lines up further,
or names a mistake): the bias as the module first makes it, `[.., n_Q, n_K]`, before any later op moves it (a
transpose where it meets the scores is then the code's, `t5.transposed` by experiment).
"""

from __future__ import annotations

from itertools import permutations
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.record import Record


def own_bias(module: Any, records: list[Record], inputs: Inputs) -> tuple[torch.Tensor, str] | None:
    """The module's own position bias `[.., n_Q, n_K]` and a note saying where it comes from; None where the code
    makes none, or more than one."""
    from attnscope.usertrace.align import VERY_NEGATIVE

    if module is None or not isinstance(module, torch.nn.Module):
        return None
    learned = {name for name, _ in module.named_parameters()}
    n_Q, n_K = inputs.sizes.get("n_Q"), inputs.sizes.get("n_K")
    if not learned or n_Q is None or n_K is None:
        return None
    fed = computed_from(records, set(inputs.tensors))  # computed from the inputs (their labels in the arguments)
    from_params = computed_from(records, learned | {n.rsplit(".", 1)[0] for n in learned})  # a layer of its own (a
    # Linear reading a one-hot of the distances, LayoutLMv3's rel_pos_bias) is labelled by its name
    tables = _tables(module)
    copies = cached(records, fed, tables)
    from_params |= _made_from(records, set(copies))
    used: set[int] = set()  # records outside the inputs' flow that meet it (added to the scores, the attention)
    for record in records:
        if record.index in fed:
            used.update(p for p in record.parents if p not in fed)
    found = []
    for record in records:
        t = record.tensor
        if record.index in fed or record.index not in from_params or not t.is_floating_point() or t.dim() < 2 \
                or tuple(t.shape[-2:]) != (n_Q, n_K) or t.dim() > 4:
            continue
        if record.index not in used and not _reaches(record, records, used):
            continue
        values = t.double()
        if bool(((values == 0) | (values == 1) | (values <= VERY_NEGATIVE)).all()):  # a mask, not a bias
            continue
        found.append(record)
    if not found:  # a copy the module keeps, read by the op that adds it (LeViT's attention_bias_cache)
        return _kept_copy(records, fed, tables, n_Q, n_K)
    roots = [r for r in found if not any(p.index in _ancestors(r, records) for p in found)]
    summed = _summed(roots, found, records) if len(roots) > 1 else None
    if summed is not None:  # parts the code sums (LayoutLMv3's 1-D and 2-D biases): their first sum holding them all
        roots = [summed]
    if len(roots) != 1:
        return None
    root, met = _valued(roots[0], records, used)
    source = sorted(params_of(met or root, records, learned, copies))
    # its values changed after it is laid out (Swin V2's 16 · sigmoid): those the code adds
    valued = f", with the values your code adds (line {met.line})" if met is not None else ""
    first = _first_made(root, records, n_Q, n_K)
    if first is not None:  # Swin's table gathered and viewed [N, N, nH] before the permute to [nH, N, N]
        record, bias = first
        made = record.label if record.names else f"{record.label} = {record.call}(..)"
        said = (f"your code makes a position bias of its own (line {record.line}: {made}, from {', '.join(source)}): "
                f"the reference adds it to its scores as your module first makes it, {list(record.tensor.shape)}, "
                f"its first axis of {n_Q} the queries', read {list(bias.shape)}{valued} (--position-bias FILE gives "
                "the reference another)")
        return bias, said
    made = root.label if root.names else str(root.details.get("op", root.label))
    said = (f"your code makes a position bias of its own (line {root.line}: {made}, from {', '.join(source)}): "
            f"the reference adds it to its scores, {list(root.tensor.shape)} as your module first makes it{valued} "
            "(--position-bias FILE gives the reference another)")
    return root.tensor.detach().float().clone(), said


def _summed(parts: list[Record], found: list[Record], records: list[Record]) -> Record | None:
    """The first tensor of `found` computed from every one of `parts` by adds alone (the biases a module sums, each
    laid out by its own ops: LayoutLMv3's `rel_pos + rel_2d_pos`), the bias the code adds; None where none is."""
    wanted = {p.index for p in parts}
    for record in found:
        up = _ancestors(record, records)
        if wanted <= up and record.func in ADDS and all(records[p].func in ADDS + MOVES for p in up - wanted
                                                       if wanted & _ancestors(records[p], records)):
            return record
    return None


ADDS = ("add", "__add__", "__radd__", "add_", "__iadd__")
MOVES = ("view", "reshape", "permute", "transpose", "contiguous", "unsqueeze", "squeeze", "flatten", "unflatten",
         "clone", "movedim", "swapaxes", "t", "T", "mT", "expand", "view_as", "reshape_as")
SHAPES_ONLY = ("view", "reshape", "contiguous", "unsqueeze", "squeeze", "flatten", "unflatten", "clone", "view_as",
               "reshape_as")


def _valued(root: Record, records: list[Record], used: set[int]) -> tuple[Record, Record | None]:
    """`root` with the values the code adds, and the tensor that holds them: where the bias is changed value by
    value after it is first laid out `[.., n_Q, n_K]` (Swin V2's `16 · sigmoid(bias)`, a scale, a cap), on its way to
    the scores, the tensor that meets them, as a Record standing where `root` does (its values viewed in root's
    shape, root's parents), so the layout is still read from what the code first made; (`root`, None) where its
    values are those added."""
    from dataclasses import replace

    met = next((records[u] for u in sorted(used) if u == root.index or root.index in _ancestors(records[u], records)),
               None)
    if met is None or met.index == root.index or met.tensor.numel() != root.tensor.numel():
        return root, None
    current, changed, values = met, False, met.tensor.detach()
    while current.index != root.index:  # value by value, or a move undone: the values laid out as root is
        parents = [records[p] for p in current.parents if records[p].tensor.is_floating_point()
                   and records[p].tensor.numel() == root.tensor.numel()]
        if len(parents) != 1:
            return root, None
        if current.func in MOVES and current.func not in SHAPES_ONLY:  # a transpose after the values changed
            undone = _undone(current, values, tuple(parents[0].tensor.shape))
            if undone is None:
                return root, None
            values = undone
        elif current.func in SHAPES_ONLY:
            values = values.reshape(parents[0].tensor.shape)
        changed, current = changed or current.func not in MOVES, parents[0]
    if not changed:
        return root, None
    return replace(root, tensor=values.reshape(root.tensor.shape)), met


def _undone(move: Record, values: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """`values`, laid out as `move` made them, laid out again as its input (of `shape`) was: a transpose or permute
    undone by its own axes, read from its arguments; None where they cannot be read."""
    given = [v for kind, v in move.args if kind == "text"]
    try:
        axes = [int(v) for v in given]
    except ValueError:
        return None
    if move.func in ("transpose", "swapaxes") and len(axes) == 2:
        back = values.transpose(axes[0], axes[1])
    elif move.func in ("t", "T", "mT") and not axes:
        back = values.transpose(-1, -2)
    elif move.func == "permute" and sorted(a % values.dim() for a in axes) == list(range(values.dim())):
        axes = [a % values.dim() for a in axes]
        back = values.permute(*[axes.index(i) for i in range(values.dim())])  # the inverse permutation
    else:
        return None
    return back if tuple(back.shape) == shape else None


def _first_made(root: Record, records: list[Record], n_Q: int, n_K: int) -> tuple[Record, torch.Tensor] | None:
    """The bias as the code first makes it, where `root` (its first tensor shaped [.., n_Q, n_K]) only moves an
    earlier one with the queries' and keys' axes elsewhere (Swin's and BEiT's table gathered by an index and viewed
    [N, N, nH], T5's embedding looked up [n_Q, n_K, n_head], then permuted): that earlier tensor read with its
    first query-sized axis as the queries' and the next key-sized one as the keys', laid out as `root` is (a
    permute that turns it otherwise is the code's, `t5.transposed` by experiment). None where no such tensor is
    made before it, or its axes cannot be told apart."""
    earliest: tuple[Record, torch.Tensor] | None = None
    current = root
    while current.func in MOVES:  # only what moves the values: before a change of values they are others
        same = [records[p] for p in current.parents if records[p].tensor.is_floating_point()
                and records[p].tensor.numel() == root.tensor.numel()]
        if len(same) != 1:
            break
        current = same[0]
        read = _read(current.tensor, root.tensor, n_Q, n_K)
        if read is not None:
            earliest = (current, read)
    if earliest is None:
        return None
    values = root.tensor.detach().float()
    moved = records[root.index].tensor.detach().float()  # root as made, before the values were changed after it
    if earliest[0].tensor.shape == root.tensor.shape and torch.equal(earliest[1], moved):
        return None  # moved without a change of layout (a contiguous, a clone): `root` says it as well
    order = next((o for o in permutations(range(moved.dim())) if moved.permute(o).shape == earliest[1].shape
                  and torch.equal(moved.permute(o), earliest[1])), None)
    if order is None:
        return earliest if torch.equal(values, moved) else None
    return earliest[0], values.permute(order).contiguous()


def _read(made: torch.Tensor, root: torch.Tensor, n_Q: int, n_K: int) -> torch.Tensor | None:
    """`made` laid out as `root` ([.., n_Q, n_K]), its first n_Q-sized axis the queries', the next n_K-sized one the
    keys', the others (the heads') in their order; None where `made` holds no such pair of axes only once."""
    shape = list(made.shape)
    q_axes = [i for i, n in enumerate(shape) if n == n_Q]
    if not q_axes:
        return None
    q = q_axes[0]
    k_axes = [i for i, n in enumerate(shape) if n == n_K and i != q]
    if not k_axes or len([n for n in shape if n in (n_Q, n_K)]) != 2:
        return None
    k = k_axes[0]
    rest = [i for i in range(len(shape)) if i not in (q, k)]
    moved = made.detach().float().permute(*rest, q, k)
    try:
        return moved.reshape(root.shape).clone()
    except RuntimeError:
        return None


def cached(records: list[Record], fed: set[int], tables: list[tuple[str, torch.Tensor]]) -> dict[int, str]:
    """The records that read a tensor the run never made, no input flowing into them, whose every value is one of a
    learned parameter's: a copy of it the module keeps (EfficientFormer's `self.ab`, its `attention_biases` gathered
    by `attention_bias_idxs` once, in a `train()` override, outside the forward; `self.ab.to(device)` reads it), by
    the parameter's name (`tables`: the module's parameters, _tables)."""
    found: dict[int, str] = {}
    for record in records:
        t = record.tensor
        if record.index in fed or not t.is_floating_point() or t.dim() < 2 or record.parents \
                or not any(kind == "text" and str(value).startswith("tensor[") for kind, value in record.args):
            continue
        name = _copied(t, tables)
        if name is not None:
            found[record.index] = name
    return found


def _tables(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's floating parameters, flat, float64; one of a single value throughout (all 0, all 1) is no table
    whose values say where a copy comes from."""
    return [(name, p.detach().reshape(-1).to(torch.float64)) for name, p in module.named_parameters()
            if p.is_floating_point() and p.numel() > 1 and p.device.type != "meta"
            and bool((p != p.reshape(-1)[0]).any())]


def _copied(tensor: torch.Tensor, tables: list[tuple[str, torch.Tensor]]) -> str | None:
    """The parameter every value of `tensor` is one of (a gather of it), by name; None where none is."""
    values = tensor.detach().reshape(-1).to(torch.float64)
    if values.unique().numel() < 2:
        return None
    return next((name for name, p in tables if bool(torch.isin(values, p).all())), None)


def _kept_copy(records: list[Record], fed: set[int], tables: list[tuple[str, torch.Tensor]], n_Q: int, n_K: int
               ) -> tuple[torch.Tensor, str] | None:
    """The bias where the code adds to its scores a tensor the run never made, `[.., n_Q, n_K]`, that holds a
    parameter's values (a cache the module keeps of its table gathered: LeViT's `attention_bias_cache`, read as it
    is in eval mode), with its note; None where it adds none, or more than one."""
    found = []
    for record in records:
        if record.index not in fed or record.func not in ADDS:
            continue
        for t in record.details.get("foreign", []):
            name = _copied(t, tables) if t.dim() <= 4 and tuple(t.shape[-2:]) == (n_Q, n_K) else None
            if name is not None:
                found.append((record, t, name))
    if len(found) != 1:
        return None
    record, bias, name = found[0]
    said = (f"your code makes a position bias of its own (line {record.line}: the tensor {record.label} adds, a copy "
            f"your module keeps of {name}'s values): the reference adds it to its scores, {list(bias.shape)} "
            "(--position-bias FILE gives the reference another)")
    return bias.float().clone(), said


def _made_from(records: list[Record], seeds: set[int]) -> set[int]:
    """`seeds` and the records computed from them."""
    out = set(seeds)
    for record in records:
        if any(p in out for p in record.parents):
            out.add(record.index)
    return out


def computed_from(records: list[Record], labels: set[str]) -> set[int]:
    """The records computed from a tensor labelled with one of `labels` (an input's name, a parameter's), directly
    or through other records."""
    out: set[int] = set()
    for record in records:
        if any(p in out for p in record.parents) or arg_names(record.args) & labels:
            out.add(record.index)
    return out


def arg_names(args: list[tuple[str, Any]]) -> set[str]:
    """The names an op's arguments give (a parameter's, an input's label), in lists and keywords too."""
    found: set[str] = set()
    for kind, value in args:
        if kind == "text" and isinstance(value, str):
            found.add(value)
        elif kind == "list":
            found |= arg_names(value)
        elif kind == "kw":
            found |= arg_names([value[1]])
    return found


def _ancestors(record: Record, records: list[Record]) -> set[int]:
    from attnscope.usertrace.align import ancestors

    return ancestors(record, records)


def _reaches(record: Record, records: list[Record], used: set[int]) -> bool:
    """Whether a record in `used` is computed from `record`."""
    return any(record.index in _ancestors(records[u], records) for u in used)


def params_of(record: Record, records: list[Record], learned: set[str], copies: dict[int, str] | None = None
               ) -> set[str]:
    """The parameters the record is computed from, by name (`copies`: records of a copy the module keeps, by the
    parameter they copy)."""
    found: set[str] = set()
    for index in _ancestors(record, records) | {record.index}:  # a parameter, or a layer holding one (an MLP's)
        found |= {n for n in arg_names(records[index].args) if n in learned or f"{n}.weight" in learned}
        if copies and index in copies:
            found.add(copies[index])
    return {n for n in found if not any(n.startswith(f"{o}.") for o in found)} or {"a parameter"}
