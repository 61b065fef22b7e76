"""Attention computed one head at a time: a projection per head and role, one softmax per head, the heads' outputs
concatenated and projected (Karpathy's `MultiHeadAttention` of `Head` modules, each with its own key, query and
value `Linear(n_embd, head_size)`; a ModuleList or ParameterList per role indexed by head).

- The heads are read from the data flow: each softmax's scores come from one projection on the left (q) and one on
  the right (k), its pattern multiplies a third (v); no projection serves two heads; one projection (o) reads every
  head's output, or none does (Raschka's `MultiHeadAttentionWrapper`, `torch.cat([head(x) for head in self.heads],
  dim=-1)` returned as it is): then the merge is the first tensor made from every head's output, and the reference
  has no output projection of its own (its o is the identity, compared up to the merge).
- Their order is the one the code's merge lays them out in: each head's output is looked up by value among what o
  reads (or in the merge), which says its columns (`torch.cat([h(x) for h in self.heads])` puts head 0 first, any
  other order or interleaving reads as it is written). n_head is the number of heads, d_head each projection's width.
- The reference holds their weights stacked by head in that order (o's columns in the same order), and the user's
  per-head tensors are stacked along a head axis for the line-up (`stacked`): each op every head runs alike, its
  heads' tensors `[.., n_head, ..]` before their last two axes, as the reference's `[n_batch, n_head, n_Q, ..]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace.record import SOFTMAXES, Record

if TYPE_CHECKING:
    from attnscope.usertrace.fused import Part

ROLES = ("q", "k", "v")


@dataclass
class Heads:
    roles: list[dict[str, str]]  # per head, in the order the merge lays them out: {q, k, v: projection name}
    outs: list[int]  # each head's output record (pattern @ V), in that order
    o: str | None  # the projection reading every head's output; None where none does (the merge is returned)
    columns: list[int]  # o's input columns, head by head in that order (each head's coordinates in its order)
    line: int  # the line of the first head's scores


def find(records: list[Record]) -> Heads | None:
    """The heads of code that computes them one at a time (two or more softmaxes, each with projections of its
    own), in the order its merge lays them out; None for any other code."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.flow import made_by, operands_at

    softmaxes = [r for r in records if r.func.split(".")[-1] in SOFTMAXES and "stacked" not in r.details]
    if len(softmaxes) < 2:
        return None
    made = made_by(records)
    sources = _sources(records, made)
    heads: list[tuple[dict[str, str], int]] = []
    for softmax in softmaxes:
        found = operands_at(records, softmax)
        if found is None or found[3] is None:
            return None
        named = [sources[i] for i in found[:3]]
        if any(len(n) != 1 for n in named):
            return None
        heads.append(({role: next(iter(n)) for role, n in zip(ROLES, named, strict=True)}, found[3]))
    used = [set(h.values()) for h, _ in heads]
    if any(used[i] & used[j] for i in range(len(used)) for j in range(i + 1, len(used))):
        return None  # a projection serving two softmaxes: not one head each (a decode step, two attentions)
    readers = [r for r in records if r.index in made and made[r.index] not in set().union(*used)
               and all(out in ancestors(r, records) for _, out in heads)]
    if len({made[r.index] for r in readers}) > 1:
        return None
    widths = [int(records[out].tensor.shape[-1]) for _, out in heads]
    if readers:
        o: str | None = made[readers[0].index]
        merged = next((records[v] for k, v in readers[0].args[1:2] if k == "rec"), None)
    else:  # no output projection: the merge is the first tensor made from every head's output, as wide as they are
        o, merged = None, next((r for r in records if r.tensor.dim() and r.tensor.shape[-1] == sum(widths)
                                and all(out in ancestors(r, records) for _, out in heads)), None)
        if merged is None:
            return None
    columns = [_columns(merged.tensor, records[out].tensor) if merged is not None else None for _, out in heads]
    if any(c is None for c in columns):  # not found by value: the heads side by side, in the order they ran
        starts = [sum(widths[:i]) for i in range(len(widths))]
        columns = [list(range(s, s + w)) for s, w in zip(starts, widths, strict=True)]
    order = sorted(range(len(heads)), key=lambda i: min(columns[i] or [0]))
    line = records[operands_at(records, softmaxes[0])[0]].line  # type: ignore[index]
    return Heads([heads[i][0] for i in order], [heads[i][1] for i in order], o,
                 [c for i in order for c in columns[i] or []], line)


def head_width(module: Any, n_head: int, d_feat: int) -> int | None:
    """What each head's projections write, read from the module before it runs: its Linear layers reading d_feat
    include 3·n_head of one width (a q, k and v of its own for each head, whatever their names); None otherwise."""
    from collections import Counter

    from torch import nn

    widths = Counter(m.out_features for m in module.modules() if isinstance(m, nn.Linear) and m.in_features == d_feat)
    found = [w for w, count in widths.items() if count == 3 * n_head]
    return found[0] if n_head > 1 and len(found) == 1 else None


def _sources(records: list[Record], made: dict[int, str]) -> dict[int, set[str]]:
    """For each record, the projections its value comes from."""
    out: dict[int, set[str]] = {}
    for r in records:
        found = {made[r.index]} if r.index in made else set()
        for p in r.parents:
            found |= out.get(p, set())
        out[r.index] = found
    return out


def _columns(merged: torch.Tensor, part: torch.Tensor) -> list[int] | None:
    """The columns (last axis) of `merged` holding `part`'s values, in the order of `part`'s last axis, the same
    for every token; None where a value is not found, or found twice."""
    if not merged.is_floating_point() or part.dtype != merged.dtype or part.numel() == 0:
        return None
    from attnscope.usertrace.valueindex import ValueIndex

    lookup = ValueIndex.of(merged)
    source = lookup.positions(part) if lookup is not None else None
    if source is None:
        return None
    columns = (source % merged.shape[-1]).reshape(-1, part.shape[-1])
    if not bool((columns == columns[0]).all()):
        return None
    return [int(c) for c in columns[0].tolist()]


def projections(heads: Heads, modules: dict[str, Any], names: list[str], role_of: Any) -> dict[str, tuple[str, Any]]:
    """{q, k, v, o: (name, weight)}: each role's per-head projections stacked by head (fused.Part, which reads
    like an nn.Linear), o's columns in the heads' order. Where a head's names say each role once and its flow
    uses them otherwise (v read from the key projection), the names hold the weights: the line-up then shows
    where the code parts from them."""
    from attnscope.usertrace.fused import Part

    chosen = [_by_names(roles, names, role_of) for roles in heads.roles]
    out: dict[str, tuple[str, Any]] = {}
    for role in ROLES:
        parts = [modules[roles[role]] for roles in chosen]
        names_of = [roles[role] for roles in chosen]
        name = f"{is_pattern(names_of)} ({len(parts)} heads stacked{_order(names_of)})"
        out[role] = (name, _stack(name, parts))
    if heads.o is None:  # no output projection: the identity over the merge, its columns in the heads' order
        from attnscope.usertrace.fused import NONE

        weight = out["q"][1].weight
        eye = torch.eye(len(heads.columns), dtype=weight.dtype, device=weight.device)
        out["o"] = (NONE, Part(NONE, eye[:, heads.columns], None))
        return out
    o = modules[heads.o]
    width = int(o.weight.shape[1])
    if heads.columns == list(range(width)):
        out["o"] = (heads.o, o)
    else:
        shown = f"{heads.o} (its columns in the heads' order)"
        out["o"] = (shown, Part(shown, o.weight.detach()[:, heads.columns],
                                o.bias.detach() if o.bias is not None else None))
    return out


def _by_names(roles: dict[str, str], names: list[str], role_of: Any) -> dict[str, str]:
    """A head's projections as its names say them, where each role is named once among the projections of the
    head's own index (`heads.0.key`, `heads.0.query`, `heads.0.value`) and the flow reads them otherwise."""
    index = {_digits(n) for n in roles.values()}
    if len(index) != 1:
        return roles
    own = [n for n in names if _digits(n) == next(iter(index))]
    named = {role: [n for n in own if role_of(n) == role] for role in ROLES}
    if all(len(found) == 1 for found in named.values()):
        return {role: found[0] for role, found in named.items()}
    return roles


def _order(names: list[str]) -> str:
    """`, merged 3, 2, 1, 0` where the heads' names number them in another order than the merge's; else ''."""
    split = [n.split(".") for n in names]
    if len({len(s) for s in split}) != 1:
        return ""
    varying = [i for i, column in enumerate(zip(*split, strict=True)) if len(set(column)) > 1]
    if len(varying) != 1 or not all(s[varying[0]].isdigit() for s in split):
        return ""
    numbers = [int(s[varying[0]]) for s in split]
    return "" if numbers == sorted(numbers) else f", merged {', '.join(map(str, numbers))}"


def _digits(name: str) -> tuple[str, ...]:
    return tuple(part for part in name.split(".") if part.isdigit())


def is_pattern(names: list[str]) -> str:
    """`heads.*.query` for heads.0.query, heads.1.query, ...: where the names differ, a star."""
    split = [n.split(".") for n in names]
    if len({len(s) for s in split}) != 1:
        return " + ".join(names)
    parts = [column[0] if len(set(column)) == 1 else "*" for column in zip(*split, strict=True)]
    return ".".join(parts) if len(set(names)) > 1 else names[0]


def _stack(name: str, parts: list[Any]) -> Part:
    """Per-head projections (Linear layers or fused.Part) as one, their rows head by head."""
    from attnscope.usertrace.fused import Part

    weight = torch.cat([p.weight.detach() for p in parts])  # [n_head·d_head, d_in]
    biases = [p.bias for p in parts]
    bias = None if all(b is None for b in biases) else torch.cat([
        b.detach() if b is not None else torch.zeros(p.weight.shape[0], dtype=weight.dtype, device=weight.device)
        for b, p in zip(biases, parts, strict=True)])
    return Part(name, weight, bias)


def stacked(records: list[Record]) -> list[Record]:
    """`records`, and after them each op every head of per-head code runs alike stacked along a head axis (before
    the tensor's last two: `[n_batch, n_Q, d_head]` -> `[n_batch, n_head, n_Q, d_head]`), in the heads' order,
    marked `stacked` with the func the heads ran; as they are for any other code."""
    from attnscope.usertrace.flow import made_by

    heads = find(records)
    if heads is None:
        return records
    made = made_by(records)
    owner = {name: h for h, roles in enumerate(heads.roles) for name in roles.values()}
    of: dict[int, set[int]] = {}
    per_head: list[list[Record]] = [[] for _ in heads.roles]
    for r in records:
        found = {owner[made[r.index]]} if r.index in made and made[r.index] in owner else set()
        for p in r.parents:
            found |= of.get(p, set())
        of[r.index] = found
        if len(found) == 1:
            per_head[next(iter(found))].append(r)
    if len({len(ops) for ops in per_head}) != 1:
        return records
    out = list(records)
    for ops in zip(*per_head, strict=True):
        first = ops[0]
        if any((r.line, r.func, r.tensor.shape, r.tensor.dtype) != (first.line, first.func, first.tensor.shape,
                                                                    first.tensor.dtype) for r in ops):
            return records  # the heads ran other ops: not one computation per head
        axis = max(first.tensor.dim() - 2, 0)
        tensor = torch.stack([r.tensor for r in ops], dim=axis)
        label = first.label
        out.append(Record(len(out), first.func, first.call, tensor, first.line, [("list", [("rec", r.index)
                                                                                            for r in ops])],
                          "stacked", True, 0, tuple(r.index for r in ops), [label] if first.names else [],
                          {"stacked": len(ops), "op": f"{first.details.get('op', first.call)}, each head's, "
                                                     f"stacked along axis {axis}"}))
    return out
