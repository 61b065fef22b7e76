"""A tensor the module makes from its input for its queries' and keys' projections alone, the values' projection
reading the input as it is (HF Wav2Vec2-Conformer's rotary attention: `query_key_states` is the hidden states
rotated by position, then `linear_q(query_key_states)`, `linear_k(query_key_states)`, `linear_v(hidden_states)`).

Read from the run, never from names: the query and key projections the reference holds each read, in their one
call, the same tensor T, of the input's shape but not its values, made from that forward input and no other tensor
input, with no Linear in its making; the value projection reads the input
itself. T is then the queries' and keys' input side, a convention the code chooses (as a norm before the
projections, prenorm.py, or a position embedding added to them, posembed.py): the reference's q and k projections
read T (`Inputs.own`), its v projection the input, so a mistake after them is still named by experiment. Where the
values read T too, or q and k read different tensors, nothing is read (no convention trace can tell from a mistake).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.record import Record

def read(records: list[Record], inputs: Inputs, module: Any, projections: dict[str, str]) -> None:
    """`inputs` with T as the queries' and keys' input where the projections the reference holds (`projections`,
    role -> name, posembed.projections) read it so; nothing where the module's inputs are read already."""
    from attnscope.usertrace.posembed import projection_input

    if module is None or inputs.own or inputs.layout not in ("row", "time") or inputs.cache is not None:
        return
    names = [projections.get(role) for role in "qkv"]
    if any(name is None or "[" in name for name in names) or len(set(names)) != 3:
        return  # a fused projection reads one tensor for all three roles
    given = set(inputs.roles)
    if len(given) != 1:
        return  # self-attention only: one forward input every role reads
    x_name = next(iter(given))
    x = inputs.tensors[x_name]
    q, k, v = (projection_input(records, name) for name in names)
    if q is None or q != k or q[0] != "rec" or not _plain(v, records, x_name, x):
        return
    made = records[q[1]]
    if not _made_from(made, records, inputs, x_name, x):
        return
    tensor = made.tensor.detach()
    tensor = tensor.transpose(0, 1) if inputs.layout == "time" else tensor
    inputs.own = {"Q": tensor, "K": tensor}
    inputs.own_from = "position"
    inputs.notes.append(
        f"your queries' and keys' projections read a tensor your module makes from its input alone ({made.label}, "
        f"line {made.line}), your values' projection the input as it is: read as the queries' and keys' input "
        "side, a convention, not a mistake: the reference's query and key projections read the same tensor")


def _plain(arg: tuple[str, Any] | None, records: list[Record], name: str, x: Any) -> bool:
    """Whether a projection's argument is the forward input `name` as it is (or a tensor equal to it)."""
    if arg is None:
        return False
    kind, value = arg
    if kind == "text":
        return bool(value == name)
    if kind != "rec":
        return False
    tensor = records[value].tensor
    return tuple(tensor.shape) == tuple(x.shape) and bool((tensor == x).all())


def _made_from(made: Record, records: list[Record], inputs: Inputs, name: str, x: Any) -> bool:
    """Whether `made` has the input's shape, not its values, and is made from the forward input `name` and no
    other tensor input, with no Linear in its making."""
    from attnscope.usertrace.align import ancestors

    tensor = made.tensor
    if tuple(tensor.shape) != tuple(x.shape) or tensor.dtype != x.dtype or bool((tensor == x).all()):
        return False
    history = [records[i] for i in ancestors(made, records) | {made.index}]
    if any(r.style == "linear" for r in history):
        return False
    texts = {t for r in history for k, t in r.args if k == "text" and isinstance(t, str)}
    return texts & set(inputs.tensors) == {name}
