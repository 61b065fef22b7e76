"""Queries, keys or values the module pools along the tokens after their projection: Hiera's queries max-pooled over
each unit (`q.view(B, heads, num_windows, q_stride, -1, head_dim).max(dim=3)`), MViTv2's pooled q, k and v (a
strided pooling or convolution of each head, the class token joined back), Linformer's keys and values projected
along the sequence (`einsum('bnd,nk->bkd', keys, proj_k)`). The scores then meet n_Q or n_K tokens that are no
projection of the input's tokens, so no reference of four projections holds them.

Read from the run, never from names: the tensor the line-up pairs with a role's projection (its `_feat` or `_split`
step) is, on the way to the scores' operand of that role (flow.operands), made into one of the same layout whose
token axis alone has another length, by an op that summarizes tokens (a pooling, a max, a mean, a sum, a product
with a matrix of the module's). That tensor, the first of its final length on the way, is the role's pooled side:
the reference's projections make what it pools (compared as `Q_feat`, `K_feat`, `V_feat`), and the reference then
attends over the code's own pooled tensors (steps `Q_pooled`, `K_pooled`, `V_pooled`, heads merged, `[n_batch, n,
n_head·d_head]`, pooledref.py), n_Q or n_K their length: a convention, with a note, and a mistake after it is named
by experiment as in any other code.

Each head's tokens a grid (MViTv2's `[B·heads, H, W, d]`, a Conv2d over `[B·heads, d, H, W]`): the token axis viewed
as two, both pooled; the grid read from the role's layout or a rearranging of it on the way (_laid_out), the pooled
one's sides from its shape (_regridded). A norm of each pooled token after it is part of it (_normed); a role pooled
with its length kept (a stride-1 conv) counts beside one pooled to another length (_kept_length).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace.cutnames import layer_of

if TYPE_CHECKING:
    from attnscope.trace import Trace
    from attnscope.usertrace.align import Layout
    from attnscope.usertrace.inputs import Inputs, ShapePlan
    from attnscope.usertrace.lined import LineUp
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Spec

# ops that summarize tokens: a pooling, a max or mean over a unit, a product with a matrix along the sequence
SUMMARIZES = ("pool", "max", "amax", "min", "amin", "mean", "sum", "einsum", "matmul", "bmm", "conv", "interpolate",
              "linear", "logsumexp")
TOKENS = {"Q": "n_Q", "K": "n_K", "V": "n_K"}
WORDS = {"Q": "queries", "K": "keys", "V": "values"}


@dataclass(frozen=True)
class Pooled:
    tensors: dict[str, torch.Tensor]  # role -> the code's pooled tensor, heads merged, [n_batch, n, n_head·d_head]
    records: dict[str, Record]  # role -> the record holding it
    before: dict[str, Record]  # role -> the tensor it was pooled from (the line-up pairs it with the projection)
    # role -> (the Linear over the tokens the code holds for it and never calls, the one it pools the other role by)
    siblings: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    # the roles whose own projection never reaches their operand, read where the code pools another's for them
    borrowed: frozenset[str] = frozenset()
    # role -> what the code pools for it, laid out as the reference's `{role}_feat` `[n_batch, n, d_feat]`, where that
    # is another role's projection (the values pooled from the keys'): compared with `{role}_feat` (held_as)
    fed: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def note(self, sizes: dict[str, int], n_input: int) -> str:
        words = {"Q": "queries", "K": "keys", "V": "values"}
        parts = "; ".join(f"your {words[role]} (line {self.records[role].line}: "
                          f"{self.records[role].details.get('op', self.records[role].call)}), "
                          f"{TOKENS[role]} = {sizes[TOKENS[role]]}" for role in "QKV" if role in self.records)
        parts += "".join(f"; your {words[role]} by {own}, which your code holds beside {other} and never calls, "
                         f"{TOKENS[role]} = {sizes[TOKENS[role]]}" for role, (own, other) in self.siblings.items())
        pooled = [role for role in "QKV" if role in self.records or role in self.siblings]
        roles = " and ".join(words[role] for role in pooled)
        steps = ", ".join(f"{role}_pooled" for role in pooled)
        return (f"your code pools its {roles} along the tokens after their projection ({parts}, from the "
                f"{n_input} tokens of the input): read as your code's own {roles}, a convention, not a mistake "
                "(pooled attention: Hiera's, MViTv2's, Linformer's projected sequence); the reference's projections "
                f"make what your code pools, compared as such, and the reference attends over your pooled {roles} "
                f"from there ({steps})")


def find(records: list[Record], lined: LineUp, parts: dict[str, Any] | None = None) -> Pooled | None:
    """The roles whose projection the code pools along the tokens before its scores (or its weighted sum) read
    them; None where no role is so pooled. `parts`: role -> the projection the reference holds for it (a Linear, or
    a fused one's rows), where the code never holds a role's projection alone."""
    from attnscope.usertrace.align import Layout, ancestors
    from attnscope.usertrace.flow import operands

    found = operands(records)
    if found is None or lined.trace is None:
        return None
    tensors, held, before, borrowed, kept, fed = {}, {}, {}, set(), set(), {}
    laid: dict[str, torch.Tensor] = {}  # role -> the tensor pooled for its own, laid out as its `_feat`
    parts = parts or {}
    for role, operand in zip("QKV", found[:3], strict=True):
        # the tensor the line-up pairs with the role's projection, equal or where it stands in the data flow (a
        # mistake before the pooling: the values made by the keys' projection)
        rows = [r for r in reversed(lined.rows) if r.reference in (f"{role}_split", f"{role}_feat")
                and r.record is not None]
        row = next((r for r in rows if r.status in ("equal", "permuted")), None) or next(
            (r for r in reversed(rows) if r.status == "differs"), None)
        if row is None or row.record is None or row.order is None:
            read = _from_projection(records, lined.trace, role, operand, parts)  # a fused projection's part
            if read is not None:
                tensors[role], held[role], before[role] = read
            continue
        start = row.record
        # the role's projection pooled wherever the code takes it (keys and values swapped at the attention: the
        # keys' pooled tensor is still the keys', which the line-up then shows read as values)
        ends = [records[i] for i in ((operand,) if role == "Q" else found[1:3])]
        end = next((e for e in ends if start.index in ancestors(e, records) | {e.index}), None)
        if end is None:  # the role's projection never reaches its operand: what the code pools there instead
            read = _from_projection(records, lined.trace, role, operand, parts)
            if read is not None:
                tensors[role], held[role], before[role] = read
                borrowed.add(role)
                continue
            # or another role's projection pooled for it (the values pooled from the keys' projection, cut anew
            # from a fused one into a grid), which the line-up then shows
            other = _from_other_role(records, lined.trace, role, operand)
            if other is not None:
                (tensors[role], held[role], before[role]), fed[role] = other
            continue
        read = _pooled_from(start, end, records, row, lined.trace, role)
        if read is not None:
            tensors[role], held[role], before[role] = read
            as_feat = _as_feat(start, Layout(row.order, row.merged, row.split), row.reference, lined.trace)
            if as_feat is not None:
                laid[role] = as_feat
            if tuple(read[0].shape) == tuple(lined.trace.step(f"{role}_feat").shape):
                kept.add(role)
    # a role pooled with its length kept (a convolution of stride 1) only beside one pooled to another length
    # where a role pools another's projection, each role's pooled tensor laid out as its `_feat` (held_as)
    fed = {**laid, **fed} if fed else {}
    return Pooled(tensors, held, before, borrowed=frozenset(borrowed), fed=fed) if set(tensors) - kept else None


def _from_other_role(records: list[Record], trace: Trace, role: str, operand: int
                     ) -> tuple[tuple[torch.Tensor, Record, Record], torch.Tensor] | None:
    """The role's operand pooled from a tensor that holds another role's projection (its `_split` or `_feat` step
    in some layout) on the operand's way, the nearest the operand first: as `_pooled_from` reads it from there, and
    that tensor laid out as the reference's `{role}_feat` `[n_batch, n, d_feat]`; None where no such tensor is on the
    way."""
    from types import SimpleNamespace

    from attnscope.usertrace.align import ancestors, compare

    end = records[operand]
    steps = [f"{other}_{kind}" for other in "KVQ" if other != role for kind in ("split", "feat")
             if f"{other}_{kind}" in trace and TOKENS[role] in trace.step(f"{other}_{kind}").dims]
    for index in sorted(ancestors(end, records), reverse=True):
        record = records[index]
        if not record.tensor.is_floating_point():
            continue
        for name in steps:
            want = trace[name]
            if record.tensor.numel() != want.numel():
                continue
            match = next(iter(compare(record, want)), None)
            if match is None or not match.equal:
                continue
            layout = match.layout
            row = SimpleNamespace(reference=name, order=layout.order, merged=layout.merged, split=layout.split)
            read = _pooled_from(record, end, records, row, trace, role)
            as_feat = _as_feat(record, layout, name, trace) if read is not None else None
            if read is not None and as_feat is not None:
                return read, as_feat
    return None


def _as_feat(record: Record, layout: Layout, name: str, trace: Trace) -> torch.Tensor | None:
    """`record`, which holds the reference's step `name` (a `_split` or `_feat`) in `layout`, as a `_feat`:
    `[n_batch, n, n_head·d_head]`; None where the layout does not undo to that step's shape."""
    try:
        held = layout.undo(record.tensor.detach(), tuple(trace[name].shape))
    except RuntimeError:
        return None
    return held.transpose(1, 2).flatten(2) if name.endswith("_split") and held.dim() == 4 else held  # heads merged


def held_as(records: list[Record], found: Pooled) -> list[Record]:
    """`records` with what the code pools for each role (`found.fed`, where one role pools another's projection: the
    values pooled from the keys'), laid out as the reference's `{role}_feat`, as records of their own after them,
    named as the tensors they lay out: the line-up compares what the code pools with the reference's projections,
    which no layout of the code's grid (`[n_batch·n_head, n_h, n_w, d_head]`) states, each `_feat` meeting its own."""
    from attnscope.usertrace.record import Record

    extra: list[Record] = []
    for role, tensor in found.fed.items():
        source = found.before[role]
        extra.append(Record(len(records) + len(extra), "reshape", "reshape", tensor, source.line,
                            [("rec", source.index)], "method", False, 0, (source.index,), [source.label],
                            {"op": f"what your code pools for its {WORDS[role]}, laid out as [n_batch, n, d_feat]"}))
    return [*records, *extra]


def _pooled_from(start: Record, end: Record, records: list[Record], row: Any, trace: Trace, role: str
                 ) -> tuple[torch.Tensor, Record, Record] | None:
    """What the code pools `start` (laid out as `row` pairs it with the role's step) into on its way to `end`, the
    role's operand: (it, heads merged, `[n_batch, n, n_head·d_head]`; its record; `start`); None where no pooling."""
    from attnscope.usertrace.align import ancestors

    step = trace.step(row.reference)
    axis = step.dims.index(TOKENS[role]) if TOKENS[role] in step.dims else None
    if axis is None or row.order is None:
        return None
    n = int(step.shape[axis])
    path = _path(start, end, records)
    # the pooling reads `start` as laid out by it, or by a rearranging of it on the way (the heads moved into the
    # batch, the grid's sides apart: `[n_batch·n_head, d_head, n_h, n_w]` for a Conv2d), each in its own layout
    for source, layout in _laid_out(start, path, row, step):
        after = [r for r in path if r.index > source.index and source.index in ancestors(r, records)]
        got = _grid_pooled(source, after, layout, tuple(step.shape), axis) \
            if layout.split is not None and layout.split[0] == axis else _line_pooled(source, after, n, layout)
        if got is None:
            continue
        pooled, held, final = got
        normed = _normed(pooled, after, held, step, axis, final)
        if normed is not None:  # the pooled tensor through a norm of each token (MViTv2's LayerNorm of each head)
            pooled, held = normed
        tensor = _merged(held, pooled.tensor, step, axis, final)
        if tensor is not None:
            return tensor, pooled, start
    return None


def _laid_out(start: Record, path: list[Record], row: Any, step: Any) -> Iterator[tuple[Record, Layout]]:
    """`start` in the layout the line-up read (`row`'s), then each rearranging of it on `path`, last first, in the
    layout under which it holds the reference's step."""
    from attnscope.usertrace.align import REARRANGING, Layout, layouts

    yield start, Layout(row.order, row.merged, row.split)
    shape, want = tuple(step.shape), step.tensor.double()
    moved = [start.index]
    for r in path:
        if r.func in REARRANGING and r.tensor.numel() == start.tensor.numel() and r.args[:1] \
                and r.args[0][0] == "rec" and r.args[0][1] in moved:
            moved.append(r.index)
    for r in reversed([r for r in path if r.index in moved]):
        for layout in layouts(shape, tuple(r.tensor.shape)):
            try:
                held = layout.undo(r.tensor, shape).double()
            except RuntimeError:
                continue
            if torch.allclose(held, want, rtol=1e-4, atol=1e-5):
                yield r, layout
                break


def _by_sibling(module: Any, records: list[Record], lined: LineUp, found: Pooled) -> Pooled:
    """`found` with the keys or the values pooled by a Linear over the tokens the module holds and never calls, of
    the shape of the one the code pools the other role by (rtdl's `key_compression` and `value_compression`), where
    the code pools that role with nothing (its values taken from the pooled keys: a mistake the line-up then shows):
    the role's projection, as the line-up pairs it, laid out as the code lays the other's for its Linear, through
    the unused one, laid back."""
    import torch.nn.functional as F
    from torch import nn

    from attnscope.usertrace.align import Layout, ancestors
    from attnscope.usertrace.dims import permutation
    from attnscope.usertrace.flow import along_tokens, linears_of
    from attnscope.usertrace.reference import mentioned

    if lined.trace is None or not isinstance(module, nn.Module) or {"K", "V"} <= set(found.tensors):
        return found
    done = "K" if "K" in found.tensors else "V" if "V" in found.tensors else None
    if done is None:
        return found
    role = "V" if done == "K" else "K"
    made, _ = linears_of(records)
    start = found.before[done]
    mixing = [r for r in records[start.index + 1:found.records[done].index + 1]
              if r.index in made and along_tokens(records, r, made) and start.index in ancestors(r, records)]
    row = next((r for r in reversed(lined.rows) if r.reference in (f"{role}_split", f"{role}_feat")
                and r.record is not None and r.status in ("equal", "permuted") and r.order is not None), None)
    if len(mixing) != 1 or row is None or row.record is None or row.order is None \
            or tuple(row.record.tensor.shape) != tuple(start.tensor.shape):
        return found
    linears = dict(module.named_modules())
    used = linears.get(made[mixing[0].index])
    spare = [name for name, m in linears.items() if isinstance(m, nn.Linear) and m is not used
             and isinstance(used, nn.Linear) and m.weight.shape == used.weight.shape
             and (m.bias is None) == (used.bias is None) and not mentioned(name, records)]
    read = records[mixing[0].parents[0]].tensor  # the projection laid out as the Linear reads it
    order = list(range(read.dim())) if torch.equal(start.tensor, read) else permutation(start.tensor, read)
    if len(spare) != 1 or order is None:
        return found
    sibling = linears[spare[0]]
    back = [order.index(a) for a in range(len(order))]
    with torch.no_grad():
        pooled = F.linear(row.record.tensor.permute(order), sibling.weight, sibling.bias).permute(back)
    step = lined.trace.step(row.reference)
    axis = step.dims.index(TOKENS[role]) if TOKENS[role] in step.dims else None
    if axis is None or not _one_axis_other(start.tensor, pooled, int(step.shape[axis])):
        return found
    tensor = _merged(Layout(row.order, row.merged, row.split), pooled, step, axis, _token_size(start.tensor, pooled))
    if tensor is None:
        return found
    return dataclasses.replace(found, tensors={**found.tensors, role: tensor},
                               siblings={role: (spare[0], made[mixing[0].index])})


def _merged(layout: Layout, pooled: torch.Tensor, step: Any, axis: int, size: int) -> torch.Tensor | None:
    """`pooled`, laid out as the code holds the role's step, in that step's layout with `size` tokens on `axis`,
    heads merged: `[n_batch, n, n_head·d_head]`; None where the layout cannot be undone."""
    shape = list(step.shape)
    shape[axis] = size
    try:
        tensor = layout.undo(pooled, tuple(shape))
    except RuntimeError:
        return None
    if "d_head" in step.dims:  # [n_batch, heads, n, d_head] -> [n_batch, n, heads·d_head]
        tensor = tensor.transpose(1, 2).flatten(2)
    return tensor.detach()


def _from_projection(records: list[Record], trace: Trace, role: str, operand: int, parts: dict[str, Any]
                     ) -> tuple[torch.Tensor, Record, Record] | None:
    """A role pooled where the code never holds its projection alone (keys and values pooled as one fused
    projection's output, then split): the first tensor on the way from the projection to the operand that lays out
    the projection's output with another number of tokens, made by an op that summarizes tokens, and of it the rows
    the reference's projection for the role holds (`parts`: role -> its Linear or a fused one's rows); (that part,
    `[n_batch, n, width]`; its record; the projection's). None where there is none."""
    from attnscope.usertrace.align import ancestors, layouts
    from attnscope.usertrace.flow import along_tokens, linears_of

    made, _ = linears_of(records)  # the projection nearest above the operand, no pooling by a weight of its own
    above = sorted(ancestors(records[operand], records) | {operand}, reverse=True)
    projection = next((records[i] for i in above if i in made and len(records[i].args) > 1
                       and not along_tokens(records, records[i], made)), None)
    name, part = parts.get(role.lower(), ("", None))
    feat = trace.step(f"{role}_feat") if f"{role}_feat" in trace else None
    rows = getattr(part, "rows", None)
    if projection is None or part is None or feat is None or projection.tensor.dim() != 3:
        return None
    if layer_of(str(name)) != str(projection.args[0][1]) and (
            rows is not None or int(projection.tensor.shape[-1]) != int(feat.shape[-1])):
        # another role's whole projection pooled for this one (Linformer's values pooled from the keys'
        # projection, `values = keys` before `proj_v`): the code's own pooled tensor, the line-up shows the rest
        return None
    b, n, width = (int(size) for size in projection.tensor.shape)
    if n != int(feat.shape[1]):
        return None
    path = _path(projection, records[operand], records)
    # the whole projection pooled, then its part cut (rows); or the part cut first, then pooled (a chunk of a fused
    # qkv projection laid out with its tokens last for a Linear over the sequence)
    for wide, cut in ((width, rows), (int(feat.shape[-1]), None)):
        for r in path:
            size = r.tensor.numel() // (b * wide)
            if not r.tensor.is_floating_point() or size == n or size * b * wide != r.tensor.numel():
                continue
            # its axes laid out anew, the features perhaps viewed as heads, none merged with another
            found = [layout for layout in layouts((b, size, wide), tuple(r.tensor.shape)) if not layout.merged]
            if not found or not any(word in m.func for m in path if m.index <= r.index for word in SUMMARIZES):
                continue
            tensor = found[0].undo(r.tensor, (b, size, wide))  # [n_batch, n', width]
            tensor = tensor[..., list(cut)] if cut is not None else tensor
            if int(tensor.shape[-1]) != int(feat.shape[-1]):
                break
            return tensor.detach(), r, projection
    return None


def _line_pooled(start: Record, path: list[Record], n: int, layout: Layout) -> tuple[Record, Layout, int] | None:
    """The role's pooled tensor on `path` where its n tokens are one axis of the code's tensor `start`: the first
    of the final length in `start`'s layout, after an op that summarizes tokens; or, where no length changes, the
    first of `start`'s shape after a pooling or a convolution (MViTv2's stride-1 pooling of the queries). (it,
    `layout`, its length)."""
    shorter = [r for r in path if _one_axis_other(start.tensor, r.tensor, n)]
    if shorter:
        final = _token_size(start.tensor, shorter[-1].tensor)
        pooled = next(r for r in shorter if _token_size(start.tensor, r.tensor) == final)
        if not any(word in r.func for r in path if r.index <= pooled.index for word in SUMMARIZES):
            return None  # cut or laid out anew, no pooling: a mistake the line-up shows
    else:
        kept, final = _kept_length(start, path), n
        if kept is None:
            return None
        pooled = kept
    return pooled, layout, final


def _grid_pooled(start: Record, path: list[Record], layout: Layout, shape: tuple[int, ...], axis: int
                 ) -> tuple[Record, Layout, int] | None:
    """As _line_pooled, where the code holds the role's tokens as a grid (an image's [.., n_h, n_w, ..], `layout`
    splitting the token axis in two) and pools both of its sides (a strided Conv2d): the first tensor on `path` that
    lays out a grid of the final size as `start` lays out its own, after an op that summarizes tokens; (it, the
    layout of its grid, its n_h·n_w)."""
    from attnscope.usertrace.align import Layout

    grids = [(r, grid) for r in path if r.tensor.is_floating_point() and r.tensor.dim() == start.tensor.dim()
             and (grid := _regridded(layout, shape, axis, tuple(start.tensor.shape), tuple(r.tensor.shape)))]
    changed = [(r, grid) for r, grid in grids if tuple(r.tensor.shape) != tuple(start.tensor.shape)]
    if changed:
        final = changed[-1][1]
        pooled = next(r for r, grid in changed if grid == final)
        if not any(word in r.func for r in path if r.index <= pooled.index for word in SUMMARIZES):
            return None
    else:
        kept = _kept_length(start, path)
        if kept is None or layout.split is None:
            return None
        pooled, final = kept, (layout.split[1], layout.split[2])
    return pooled, Layout(layout.order, layout.merged, (axis, *final)), final[0] * final[1]


def _regridded(layout: Layout, shape: tuple[int, ...], axis: int, before: tuple[int, ...], after: tuple[int, ...]
               ) -> tuple[int, int] | None:
    """The grid (a, b) under which `after` lays out the reference's step (`shape`, its token axis `axis` viewed as
    a grid by `layout`) as `before` lays out the original grid: the same axes merged, the grid's two sides alone of
    another size; None where there is none."""
    def grouped(source: tuple[int, ...]) -> list[int] | None:
        permuted = [source[i] for i in layout.order]
        sizes, i = [], 0
        for want in before:  # the permuted axes each of `before`'s axes merges, in order
            size = 1
            while i < len(permuted) and (size < want or (size == want and permuted[i] == 1 and want != 1)):
                size, i = size * permuted[i], i + 1
            if size != want:
                return None
            sizes.append(i)
        return sizes if i == len(permuted) else None

    if layout.split is None:
        return None
    source = layout.source(shape)
    ends = grouped(source)
    if ends is None:
        return None
    found = []
    for a in range(1, int(shape[axis]) + 1):
        for b in range(1, int(shape[axis]) + 1):
            sized = (*source[:axis], a, b, *source[axis + 2:])
            permuted = [sized[i] for i in layout.order]
            made, lo = [], 0
            for hi in ends:
                size = 1
                for d in permuted[lo:hi]:
                    size *= d
                made.append(size)
                lo = hi
            if tuple(made) == after:
                found.append((a, b))
    return found[0] if len(found) == 1 else None


def _kept_length(start: Record, path: list[Record]) -> Record | None:
    """The first tensor of `start`'s shape on `path` made by or after a pooling or a convolution: the role pooled
    with its length kept (a stride of 1)."""
    mixed = False
    for r in path:
        mixed = mixed or any(word in r.func for word in ("pool", "conv"))
        if mixed and tuple(r.tensor.shape) == tuple(start.tensor.shape) and r.tensor.is_floating_point():
            return r
    return None


def _normed(pooled: Record, path: list[Record], held: Layout, step: Any, axis: int, size: int
            ) -> tuple[Record, Layout] | None:
    """The norm the code applies to `pooled` (laid out by `held`) on the way, with nothing but rearranging ops
    between (the heads' tokens flattened, then a LayerNorm), and the layout under which it holds the reference's
    step: the layout of the norm's input, read by its values, which hold the pooled ones rearranged; None where
    there is none."""
    from attnscope.usertrace.align import REARRANGING, layouts

    shape = list(step.shape)
    shape[axis] = size
    try:
        want = held.undo(pooled.tensor, tuple(shape)).double()
    except RuntimeError:
        return None
    chain, norm = [pooled.index], None
    for r in path:
        if r.index <= pooled.index or not r.args[:1] or r.args[0][0] != "rec" or r.args[0][1] != chain[-1] \
                or r.tensor.numel() != pooled.tensor.numel():
            continue
        if "norm" in r.func:
            norm = r
        elif r.func not in REARRANGING:
            break
        chain.append(r.index)
    if norm is None:
        return None
    given = next(r for r in path + [pooled] if r.index == norm.args[0][1])
    for layout in layouts(tuple(shape), tuple(given.tensor.shape)):
        try:
            if torch.allclose(layout.undo(given.tensor, tuple(shape)).double(), want, rtol=1e-5, atol=1e-6):
                return norm, layout
        except RuntimeError:
            continue
    return None


def _path(start: Record, end: Record, records: list[Record]) -> list[Record]:
    """The records on the way from `start` to `end` in the data flow: made from `start`, `end` made from them, `end`
    itself last."""
    from attnscope.usertrace.align import ancestors

    on_path = ancestors(end, records) | {end.index}
    return [r for r in records[start.index + 1:end.index + 1]
            if r.index in on_path and start.index in ancestors(r, records)]


def _one_axis_other(start: torch.Tensor, tensor: torch.Tensor, n: int) -> bool:
    """`tensor` is `start`'s layout with one axis, of n tokens there, of another length."""
    if not tensor.is_floating_point() or tensor.dim() != start.dim():
        return False
    other = [a for a in range(start.dim()) if start.shape[a] != tensor.shape[a]]
    return len(other) == 1 and start.shape[other[0]] == n


def _token_size(start: torch.Tensor, tensor: torch.Tensor) -> int:
    axis = next(a for a in range(start.dim()) if start.shape[a] != tensor.shape[a])
    return int(tensor.shape[axis])


def read(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool, spec: Spec,
         lined: LineUp) -> tuple[Inputs, LineUp, str] | None:
    """(the inputs with n_Q or n_K the pooled length, the line-up with the reference attending over the code's
    pooled tensors, a note), where the code pools a role after its projection and that line-up fits better than
    `lined`; None otherwise (a mask, a causal or window rule, RoPE or a cache: positions the pooling leaves
    undefined)."""
    from attnscope.usertrace.ranking import better_fit
    from attnscope.usertrace.relined import line_up_again

    if lined.divergence is None or spec.pooled is not None or inputs.mask is not None or spec.causal \
            or spec.window or spec.rope_base is not None or inputs.cache is not None or spec.layout == "col":
        return None
    found = find(records, lined, _parts(module, records, shapes))
    if found is None:
        return None
    if found.borrowed:  # a Linear over the tokens the code holds for that role and never calls comes first
        own = Pooled({r: t for r, t in found.tensors.items() if r not in found.borrowed},
                     {r: t for r, t in found.records.items() if r not in found.borrowed},
                     {r: t for r, t in found.before.items() if r not in found.borrowed})
        by_sibling = _by_sibling(module, records, lined, own) if own.tensors else own
        found = by_sibling if by_sibling.siblings else found
    else:
        found = _by_sibling(module, records, lined, found)
    sizes = dict(inputs.sizes)
    n_input = int(sizes["n_Q"]) if "Q" in found.tensors else int(sizes["n_K"])
    for role, tensor in found.tensors.items():
        sizes[TOKENS[role]] = int(tensor.shape[-2])
    if "K" in found.tensors and "V" in found.tensors and sizes["n_K"] != int(found.tensors["V"].shape[-2]):
        return None
    pooled = dataclasses.replace(inputs, sizes=sizes, notes=[])
    again = line_up_again(module, shapes, pooled, held_as(records, found), train,
                          dataclasses.replace(spec, pooled=found.tensors))
    if again is None:
        return None
    # a reading that names the mistake by experiment where the first left it unnamed is kept at any step (the values
    # pooled from the keys' projection: their V_feat differs, which only the pooled reading compares)
    named = again.divergence is not None and again.divergence.experiment is not None \
        and lined.divergence.experiment is None
    if not (better_fit(again, lined) or named):
        return None
    return pooled, again, found.note(sizes, n_input)


def _parts(module: Any, records: list[Record], shapes: ShapePlan) -> dict[str, Any]:
    """role -> (name, the projection the reference holds for it under its likeliest reading: a Linear, or a fused
    one's rows); empty where none is read."""
    from attnscope.errors import UsageError
    from attnscope.usertrace.reference import find_projections

    try:
        readings = find_projections(module, records, shapes.n_head, shapes.fixed.get("d_head"))
    except UsageError:
        return {}
    return dict(readings[0].linears) if readings else {}
