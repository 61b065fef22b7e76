"""A projection the code never uses, read from the data flow: where one weight writes two (or all three) of q, k
and v (`value = self._key_dense(value)`, `v = x @ self.W_K`, `self.wk(x)` twice, a copy-paste slip) and the module
holds, unused, weights of that one's shape and kind (Keras' `_value_dense`, a `W_V` nn.Parameter, a `wv` Linear),
those are the projections of the roles it took: the reference holds them there, and the line-up shows where the
code takes the keys' weight instead (the catalog's kv.values_from_keys names it by experiment).

Which role each unused weight stands for: its name where it says one of the roles the writer took; else the
writer keeps the role its own name says; else the writer and the unused weights take the roles it wrote in the order
the module registers them (q, k, v as they are declared: an unused weight declared before the writer is the keys'
where the writer makes keys and values, `k = self.c(x)` beside an unused `self.b`; after it, the values').

A weight the code calls and then throws away (`v = self.Wv(x)` computed, and the pattern multiplied by `k`: its
product reaches nothing the call returns) is unused as well: it never turns the weight that took its role into a
fused one (read as a K/V projection split in halves).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record

ROLES = ("q", "k", "v")


def discarded(records: list[Record]) -> set[str]:
    """The projections (by name) the code calls where no product of theirs reaches what the call returns; empty
    where the run marks nothing returned."""
    returned = [r for r in records if "returned" in r.details]
    if not returned:
        return set()
    live: set[int] = set()
    stack = [r.index for r in returned]
    while stack:
        index = stack.pop()
        if index not in live:
            live.add(index)
            stack.extend(records[index].parents)
    calls: dict[str, bool] = {}
    for r in records:
        if r.style == "linear" and r.args and r.args[0][0] == "text":
            calls[r.args[0][1]] = calls.get(r.args[0][1], False) or r.index in live
    return {name for name, used in calls.items() if not used}


def sibling_reading(shared: dict[str, str], modules: dict[str, Any], spare: list[str],
                    role_of: Any, thrown: set[str] | None = None) -> tuple[dict[str, str], str] | None:
    """{role: weight name} with the unused weights `spare` (in the module's order; `thrown`: those the code calls
    and throws the product of away) in the roles a weight of their shape took besides its own, and how; None where
    no one weight writes two roles, or the unused weights of its shape are not one for each role it took too
    many."""
    writers: dict[str, list[str]] = {}
    for role in ROLES:
        writers.setdefault(shared[role], []).append(role)
    many = [(name, roles) for name, roles in writers.items() if len(roles) > 1]
    if len(many) != 1:
        return None
    writer, roles = many[0]
    shape = tuple(modules[writer].weight.shape)
    siblings = [s for s in spare if s != writer and s not in shared.values()
                and tuple(modules[s].weight.shape) == shape and type(modules[s]) is type(modules[writer])]
    if len(siblings) != len(roles) - 1:
        return None
    found = dict(shared)
    open_roles = list(roles)
    named = {s: role_of(s) for s in siblings}
    for sibling, role in named.items():  # an unused weight whose name says one of the roles
        if role in open_roles and list(named.values()).count(role) == 1:
            found[role] = sibling
            open_roles.remove(role)
    rest = [s for s in siblings if s not in found.values()]
    if role_of(writer) in open_roles:
        keeps = role_of(writer)
    else:  # no name says it: the roles go in the order the module registers its weights, the writer's among them
        order = list(modules)
        ranked = sorted([writer, *rest], key=lambda n: order.index(n) if n in order else len(order))
        keeps = open_roles[ranked.index(writer)]
    open_roles.remove(keeps)
    for sibling, role in zip(rest, open_roles, strict=True):
        found[role] = sibling
    found[keeps] = writer
    taken = ", ".join(f"{found[r]} as {r.upper()}" for r in roles if found[r] != writer)
    ran = [found[r] for r in roles if found[r] != writer and found[r] in (thrown or set())]
    how = (f"data flow, with weights your code never uses: {writer} makes your {', '.join(r.upper() for r in roles)}; "
           f"the reference holds {taken}, of {writer}'s shape, there"
           + (f" ({', '.join(ran)} runs, and nothing it makes reaches your output)" if ran else ""))
    return found, how


def left_value(module: Any, records: list[Record], writer: Any, thrown: set[str], mentioned: Any
               ) -> tuple[str, Any] | None:
    """Where one projection makes both the keys and the values (`v = k`): the module's weight the code never uses
    (or runs and throws the product of away) that fits as the values' projection beside it: an nn.Linear as wide as
    the keys' `writer` ([out, in]), or a 2-D parameter outside every Linear of its shape (read as `x @ W`, [in, out],
    else as F.linear holds it, [out, in]), whatever their kinds and names. A value projection left unused, never
    a shared-KV design (which holds no such weight); None where there is none, or more than one."""
    from torch import nn

    from attnscope.usertrace import fused

    out, into = writer.out_features, writer.in_features
    found: list[tuple[str, Any]] = []
    held: set[str] = set()
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            held |= {f"{name}.{p}" for p, _ in m.named_parameters(recurse=False)}
            if (m.out_features, m.in_features) == (out, into) and (not mentioned(name, records) or name in thrown):
                found.append((name, m))
    for name, p in module.named_parameters():
        if name in held or p.dim() != 2 or mentioned(name, records):
            continue
        weight = p.detach().t() if tuple(p.shape) == (into, out) else p.detach() if tuple(p.shape) == (out, into) \
            else None
        if weight is not None:
            found.append((name, fused.Part(name, weight, None)))
    return found[0] if len(found) == 1 else None


def left_rows(module: Any, names: list[str], writer: Any) -> tuple[str, Any] | None:
    """Where one slice of a parameter's rows makes both the keys and the values (DETR's inline in_proj with the
    value block's `in_proj_weight[E:2E]` copied from the key block's): the block of that parameter's rows no
    projection reads, as many as the writer's, as the values' projection (its bias the same rows of the 1-D
    parameter the writer's bias is cut from); None where no one such block is left. `names`: the projections the
    code reads, rows cut from a parameter named `P[a:b]` (weightrows.py); `writer`: the keys' and values' one."""
    import torch

    from attnscope.usertrace import fused
    from attnscope.usertrace.weightrows import cut_rows

    found = cut_rows(getattr(writer, "name", None) or "")  # a Part cut from a parameter (an nn.Linear is none)
    params = dict(module.named_parameters())
    if found is None or not found[3] or found[0] not in params or params[found[0]].dim() != 2:
        return None
    parent, a, size = found[0], found[1], found[2] - found[1]
    rows = params[parent].shape[0]
    read = torch.zeros(rows, dtype=torch.bool)
    for name in names:
        held = cut_rows(name)
        if held is not None and held[0] == parent:
            read[held[1]:held[2]] = True
    left = [i for i in range(rows) if not read[i]]
    if len(left) != size or left != list(range(left[0], left[0] + size)):
        return None
    start, end = left[0], left[0] + size
    weight = params[parent].detach()[start:end]
    if tuple(weight.shape) != tuple(writer.weight.shape):
        return None
    bias = None
    if writer.bias is not None:  # the same rows of the 1-D parameter the writer's bias is cut from
        owner = next((p for p in params.values() if p.dim() == 1 and p.numel() == rows
                      and bool((p.detach()[a:a + size] == writer.bias).all())), None)
        if owner is None:
            return None
        bias = owner.detach()[start:end]
    name = f"{parent}[{start}:{end}]"
    return name, fused.Part(name, weight, bias)

