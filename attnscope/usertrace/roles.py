"""Which of the forward's tensor parameters is the queries', the keys' and the values' input, read from the code,
never from their order in the signature (OpenNMT's `forward(key, value, query, mask)`).

Where every tensor parameter is named for a role of its own (`query`, `key`, `value`, `q`, `k`, `v`), the names
say the roles: where the flow says otherwise (the code reads its `key` argument as values) that is a swap in the
code, which the line-up shows and the catalog names (`kv.swapped`). Otherwise the code is run once on inputs drawn
for the signature's order, without a mask (a mask shaped for the wrong lengths would stop it before its scores),
its prints dropped, and the data flow says the roles (flow.input_roles): Q is the input the scores' left operand
comes from, K the right one's, V the pattern's partner's.

The same reading says whether an optional memory parameter (`key_value_states=None`: BART's, Whisper's, T5's
cross-attention, which attend to their own input when it is None) is where the keys and values come from, when
trace is asked for keys of another length than the queries (--nk).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnscope.usertrace.load import Plan
    from attnscope.usertrace.record import Record

ORDER = ("Q", "K", "V")


def by_names(names: list[str]) -> dict[str, str] | None:
    """{parameter: role} where each tensor parameter is named for a role of its own (`query`, `k`, `values`):
    three for Q, K and V, or two for Q and K (or V); None otherwise. Of three, one may be named for none where the
    other two name two roles (BART's `forward(hidden_states, key_states, value_states)`): it has the role left."""
    from attnscope.usertrace.reference import role_of

    roles = [role_of(name) for name in names]
    if len(names) == 3 and roles.count(None) == 1 and len({r for r in roles if r is not None} - {"o"}) == 2:
        left = ({"q", "k", "v"} - set(roles)).pop()
        roles = [left if role is None else role for role in roles]
    if any(role is None or role == "o" for role in roles) or len(set(roles)) != len(roles):
        return None
    said = {name: str(role).upper() for name, role in zip(names, roles, strict=True)}
    if len(names) == 3 or (len(names) == 2 and "Q" in said.values()):
        return {name: "K" if role == "V" and len(names) == 2 else role for name, role in said.items()}
    return None


def read(plan: Plan, records: list[Record]) -> tuple[Plan, str | None]:
    """`plan` with its tensors in the order Q, K(, V) as the code uses them, and a note where that is not the
    signature's order; `plan` as it is where neither the flow nor the names say otherwise."""
    from attnscope.usertrace.flow import input_roles

    names = list(plan.tensors)
    flowed = input_roles(records, names)
    named = by_names(names)
    chosen = named or flowed
    if chosen is None:
        return plan, None
    order = sorted(names, key=lambda name: ORDER.index(chosen[name]))
    if order == names:
        return plan, None
    parts = {"Q": "the scores' left operand (Q)", "K": "their right operand (K)",
             "V": "what the pattern multiplies (V)"}
    if named is None or named == flowed:
        said = ", ".join(f"{parts[chosen[n]]} comes from {n}" for n in order)
        note = f"inputs by role, read from your code's data flow: {said}; not by their order in the signature"
    else:
        note = (f"inputs by role, read from their names ({', '.join(f'{n} = {chosen[n]}' for n in order)}), not by "
                "their order in the signature")
    return dataclasses.replace(plan, tensors=order), note


def uses_memory(plan: Plan, records: list[Record]) -> bool:
    """Whether the code takes its keys and values from the memory parameter fed as the plan's second tensor (its
    scores' right operand and the pattern's partner come from it, the left operand from the first)."""
    from attnscope.usertrace.flow import input_roles

    return input_roles(records, list(plan.tensors)) == {plan.tensors[0]: "Q", plan.tensors[1]: "K"}
