"""Position embeddings added to what the queries' and keys' projections read, but not the values' (DETR's
`q_proj(x + pos)`, `k_proj(x + pos)`, `v_proj(x)`; its cross-attention's keys `k_proj(memory + spatial_pos)`,
values `v_proj(memory)`; SAM's two-way transformer `q = queries + query_pe; k = keys + key_pe; v = keys`).

Read from the run, never from names: the projection the reference holds for a role reads, in its one call, an add
whose one side is that role's forward input and whose other side comes from none of the forward's tensor inputs
(a Parameter or buffer of the module's, a position tensor the forward was given, one made from an arange). That
add's result is then the reference's input for the role (`Inputs.own`), so Q_feat, K_feat and V_feat are what
the module's projections read, and a mistake after them is still named by experiment. Values may read it only
where the keys read that same tensor (position added to all three is the input the module attends over).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from attnscope.usertrace.align import Layout
    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.record import Record

ADDS = ("add", "__add__", "__radd__")
ROLES = {"q": "Q", "k": "K", "v": "V"}
MOVES = ("transpose", "permute", "movedim", "swapaxes", "contiguous", "t")  # ops that move a sum's axes alone


@dataclass
class Added:
    tensors: dict[str, torch.Tensor]  # role (Q, K, V) -> what its projection reads, [n_batch, n, d]
    lines: dict[str, int]  # role -> the add's line
    terms: dict[str, str]  # role -> what was added, as the code writes it
    moved: bool = False  # the values' projection read the sum, the keys' their input alone: given to the keys


def projections(module: Any, records: list[Record], n_head: int | None, d_head: int | None) -> dict[str, str]:
    """The projections the reference holds, role (q, k, v, o) -> the name its records write (a fused one's rows as
    `to_qkv[0:32]`), of the likeliest reading; empty where none is found. Read once a run, for this module's `read`
    and prenorm.py's."""
    from attnscope.errors import UsageError
    from attnscope.usertrace.reference import find_projections

    if module is None:
        return {}
    try:
        readings = find_projections(module, records, n_head, d_head)
    except UsageError:
        return {}
    return {role: name for role, (name, _) in readings[0].linears.items()} if readings else {}


def read(records: list[Record], inputs: Inputs, module: Any, names: dict[str, str], fed: list[str]) -> None:
    """`inputs` with the sums the projections the reference holds (`names`, from `projections`) read, where they
    read such sums (`find`); `fed`: the forward's parameters trace gave a position embedding (load.EMBEDDING_WORDS)."""
    if module is None or inputs.own:
        return
    added = find(records, inputs, module, names, fed)
    if added is not None:
        apply(inputs, added)


def find(records: list[Record], inputs: Inputs, module: Any, projections: dict[str, str], fed: list[str]
         ) -> Added | None:
    """What each of the q, k, v projections (`projections`: role -> its name as the records write it; the query,
    key and value arguments of nn.MultiheadAttention's kernel) reads where it is its role's input plus a term of no
    input's; None where no query or key projection reads such a sum."""
    if module is None or inputs.layout not in ("row", "time") or inputs.cache is not None or inputs.own:
        return None
    by_role = {role: name for name, role in inputs.roles.items()}
    kernel = next((r for r in records if r.func.endswith("multi_head_attention_forward")), None)
    found = Added({}, {}, {})
    for i, (short, role) in enumerate(ROLES.items()):
        given = by_role.get(role) or (by_role.get("K") if role == "V" else None) or by_role["Q"]
        arg = _argument(kernel, i) if kernel is not None else projection_input(records, projections.get(short), i)
        read = _sum_read(records, arg, given, inputs, {*_held(module), *fed}) if arg is not None else None
        if read is not None:
            tensor, found.lines[role], found.terms[role] = read
            found.tensors[role] = tensor.transpose(0, 1) if inputs.layout == "time" else tensor  # [n_batch, n, d]
    if "V" in found.tensors and "K" not in found.tensors and "Q" in found.tensors:
        # values given a position the keys were not: no convention does that (DETR's, MMCV's and SAM's add it to
        # what the queries and keys read), so the reference's keys read that sum and its values the input alone,
        # and code whose keys and values are swapped is named so by experiment (kv.swapped)
        found.tensors["K"], found.lines["K"], found.terms["K"] = (
            found.tensors.pop("V"), found.lines.pop("V"), found.terms.pop("V"))
        found.moved = True
    if not found.tensors.keys() & {"Q", "K"}:
        return None
    if "V" in found.tensors and ("K" not in found.tensors or found.lines["V"] != found.lines["K"]
                                 or not bool((found.tensors["V"] == found.tensors["K"]).all())):
        return None  # values given a position, the keys another: no convention trace can tell from a mistake
    return found


def projection_input(records: list[Record], name: str | None, role: int | None = None) -> tuple[str, Any] | None:
    """What the one call of projection `name` reads (an argument as records write it); None where it is called
    other than once. `role` (0 q, 1 k, 2 v): of a projection called more than once (DETR's value block with the key
    block's rows, `in_proj_weight[E:2E]` for both), the one call that reaches that role's operand of the attention."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.flow import operands

    calls = [r for r in records if r.style == "linear" and len(r.args) > 1 and r.args[0] == ("text", name)]
    found = operands(records) if len(calls) > 1 and role is not None else None
    at = found[role] if found is not None and role is not None else None
    if at is not None:
        above = ancestors(records[at], records) | {at}
        calls = [r for r in calls if r.index in above]
    return calls[0].args[1] if name is not None and len(calls) == 1 else None


def _argument(kernel: Record, index: int) -> tuple[str, Any] | None:
    """The query (0), key (1) or value (2) argument of F.multi_head_attention_forward, as records write it."""
    names = ("query", "key", "value")
    given = [a for a in kernel.args if a[0] != "kw"]
    if index < len(given) and given[index][0] == "rec":
        return given[index]
    return next((a[1][1] for a in kernel.args if a[0] == "kw" and a[1][0] == names[index]), None)


def _sum_read(records: list[Record], arg: tuple[str, Any], given: str, inputs: Inputs, held: set[str]
              ) -> tuple[torch.Tensor, int, str] | None:
    """`arg`, what a projection reads, where it is the forward input `given` plus a term of no forward input's
    (`held`: the module's parameters and buffers, the embeddings trace fed): (the sum, its line, the term as
    written)."""
    from attnscope.usertrace.align import ancestors

    if arg[0] != "rec":
        return None
    added = records[arg[1]]
    while added.func in MOVES and len(added.parents) == 1:  # the sum moved to the kernel's layout first (MMCV's
        added = records[added.parents[0]]  # batch_first `query = query + query_pos`, then `query.transpose(0, 1)`)
    x = inputs.tensors[given]
    if added.func not in ADDS or added.tensor.dim() != x.dim() or len(added.args) != 2:
        return None
    sides = [_reads(records, side, inputs, ancestors) for side in added.args]
    plain = [(i, layout) for i, (tensor, texts) in enumerate(sides) if texts is not None
             and texts & set(inputs.tensors) == {given} and tensor is not None
             and (layout := _laid_as(tensor, x)) is not None]
    if len(plain) != 1:
        return None
    (side, layout), = plain
    tensor, term = sides[1 - side]
    kind, value = added.args[1 - side]
    if term is None or term & set(inputs.roles) or (tensor is None and value not in held):
        return None  # a term from an input attended over, or a number: no position embedding
    text = str(value) if kind == "text" else records[value].label
    return layout.undo(added.tensor.detach(), tuple(x.shape)), added.line, text


def _laid_as(tensor: torch.Tensor, x: torch.Tensor) -> Layout | None:
    """How `tensor` lays out the forward input `x`, a permutation of its axes (the same one first: Mask2Former's
    time-first code permutes its inputs, `hidden_states.permute(1, 0, 2)`, before it adds the position), as the
    line-up reads layouts (align.layouts); None where none gives `x` back."""
    from attnscope.usertrace.align import layouts

    return next((layout for layout in layouts(tuple(x.shape), tuple(tensor.shape), swaps=True)
                 if not layout.merged and layout.split is None
                 and bool((layout.undo(tensor, tuple(x.shape)) == x).all())), None)


def _held(module: Any) -> set[str]:
    """The names of the module's parameters and buffers (`x + self.pos_embed`)."""
    return {name for name, _ in (*module.named_parameters(), *module.named_buffers())}


def _reads(records: list[Record], arg: tuple[str, Any], inputs: Inputs, ancestors: Any
           ) -> tuple[torch.Tensor | None, set[str] | None]:
    """An add's argument: its tensor (None for a number or a name of no tensor) and the names its history reads."""
    kind, value = arg
    if kind == "rec":
        source = records[value]
        history = [records[i] for i in ancestors(source, records) | {source.index}]
        return source.tensor, {text for r in history for k, text in r.args if k == "text" and isinstance(text, str)}
    if kind == "text" and value in inputs.tensors:
        return inputs.tensors[value], {value}
    return None, ({str(value)} if kind == "text" else None)


def apply(inputs: Inputs, added: Added) -> None:
    """`inputs` with what the projections read as the reference's inputs, and the note that says so."""
    inputs.own = dict(added.tensors)
    inputs.own_from = "position"
    words = {"Q": "queries'", "K": "values'" if added.moved else "keys'", "V": "values'"}  # moved: as the code reads
    sums: dict[tuple[int, str], list[str]] = {}
    for role in sorted(added.tensors, key="QKV".index):
        sums.setdefault((added.lines[role], added.terms[role]), []).append(words[role])
    said = "; ".join(f"the {' and '.join(roles)} + {term} (line {line})" for (line, term), roles in sums.items())
    plain = [words[r] for r in "QKV" if r not in added.tensors]
    alone = f", the {' and '.join(plain)} your input alone" if plain else ""
    if added.moved:
        inputs.notes.append(f"your projections read your input plus a position embedding no input makes: {said}, "
                            "the keys' your input alone; the reference's queries and keys read those sums and its "
                            "values your input, as a position is added to what the queries and keys read (DETR's, "
                            "MMCV's), never to the values alone")
        return
    inputs.notes.append(f"your projections read your input plus a position embedding no input makes: {said}{alone}; "
                        "the reference's projections read the same sums")
