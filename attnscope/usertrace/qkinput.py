"""A tensor the module makes from its input for its queries' and keys' projections alone, the values' projection
reading the input as it is (HF Wav2Vec2-Conformer's rotary attention: `query_key_states` is the hidden states
rotated by position, then `linear_q(query_key_states)`, `linear_k(query_key_states)`, `linear_v(hidden_states)`).

Read from the run, never from names: the query and key projections the reference holds each read, in their one
call, the same tensor T, of the input's shape but not its values, made from that forward input and no other tensor
input, with no Linear in its making; the value projection reads the input
itself. T is then the queries' and keys' input side, a convention the code chooses (as a norm before the
projections, prenorm.py, or a position embedding added to them, posembed.py): the reference's q and k projections
read T (`Inputs.own`), its v projection the input, so a mistake after them is still named by experiment. Where the
values read T too and T is the input turned by position (each token's norm kept: RoPE on the input), T is still
the queries' and keys' input side, and the values' the input, as RoPE leaves the values: the line-up then shows
the values, and ropetrials' rope.on_values names it. Where the queries read T turned by position and the keys the
input itself (the values the input or T), T is still the queries' and keys' input side (RoPE never turns the queries
alone), and the line-up shows the keys apart. Where the values read another T too, or q and k read different tensors
otherwise, nothing is read (no convention trace can tell from a mistake).
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
    if q is None or q[0] != "rec":
        return
    made = records[q[1]]
    if q != k:  # the keys read another tensor: only where the queries' is the input turned by position
        _keys_apart(made, [a for a in (k, v) if a != q], records, inputs, x_name, x)
        return
    # the values' projection reading the queries' and keys' tensor too, where it is the input turned by position
    # (RoPE on the input): the reference's values read the input, as RoPE leaves them; the line-up then shows it
    turned = v == q and turned_by_position(made.tensor, x)
    if not (turned or _plain(v, records, x_name, x)) or not _made_from(made, records, inputs, x_name, x):
        return
    _held_as_qk(made, inputs)
    if turned:
        inputs.notes.append(
            f"your query, key and value projections read a tensor your module makes from its input alone "
            f"({made.label}, line {made.line}), each token turned by its position with its norm kept (a rotation, "
            "RoPE on the input): read as the queries' and keys' input side, a convention; the reference's value "
            "projection reads the input as it is, as RoPE rotates only the queries and the keys")
        return
    inputs.notes.append(
        f"your queries' and keys' projections read a tensor your module makes from its input alone ({made.label}, "
        f"line {made.line}), your values' projection the input as it is: read as the queries' and keys' input "
        "side, a convention, not a mistake: the reference's query and key projections read the same tensor")


def _keys_apart(made: Record, others: list[Any], records: list[Record], inputs: Inputs, x_name: str,
               x: Any) -> None:
    """The queries read T, the input turned by position (RoPE on the input), and the keys the input as it is (with
    the values, or the values reading T: Wav2Vec2-Conformer's rotary with `linear_k(value_states)` and
    `linear_v(query_key_states)`): T is still the queries' and keys' input side, as no convention rotates the
    queries alone, so the line-up shows where the keys part from it and the catalog names the swap of the inputs
    (kv.swapped) by experiment; nothing where the keys read anything else."""
    if not turned_by_position(made.tensor, x) or not all(_plain(a, records, x_name, x) for a in others) \
            or not _made_from(made, records, inputs, x_name, x):
        return
    _held_as_qk(made, inputs)
    inputs.notes.append(
        f"your query projection reads a tensor your module makes from its input alone ({made.label}, line "
        f"{made.line}), each token turned by its position with its norm kept (a rotation, RoPE on the input), and "
        "your key projection the input as it is: read as the queries' and keys' input side, as RoPE rotates the "
        "queries and the keys alike; the reference's key projection reads that tensor too")


def _held_as_qk(made: Record, inputs: Inputs) -> None:
    """`made`'s tensor as the queries' and keys' input (batch-first, as the reference reads its inputs)."""
    tensor = made.tensor.detach()
    tensor = tensor.transpose(0, 1) if inputs.layout == "time" else tensor
    inputs.own = {"Q": tensor, "K": tensor}
    inputs.own_from = "position"


def turned_by_position(tensor: Any, x: Any) -> bool:
    """Whether `tensor` is the input `x` `[n_batch, n, d_feat]` turned token by token with each token's norm kept,
    and not `x` itself: a rotation by position (RoPE on the input, whatever its pairing or tables)."""
    import torch

    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(x.shape) or x.dim() != 3 \
            or not tensor.is_floating_point():
        return False
    t, y = tensor.detach().double(), x.detach().double()
    if torch.allclose(t, y, rtol=1e-4, atol=1e-5):
        return False
    return torch.allclose(t.norm(dim=-1), y.norm(dim=-1), rtol=1e-4, atol=1e-5)


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
