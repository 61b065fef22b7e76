"""Joint attention: the code joins two streams along the tokens before one attention (Flux's double-stream block,
SD3's MMDiT `JointAttnProcessor2_0`, CogVideoX's, HunyuanDiT's): each stream made by projections (and norms) of its
own, q, k and v joined by `torch.cat` on the token axis, one attention over all the tokens, and the output split
back into the streams, each with an output projection of its own. No multi-head reference of four projections holds
that, so the reference starts where the streams meet: attnscope's MultiHeadAttention with identity projections,
run on the code's own joined q, k and v (merged to `[n_batch, n, n_head·d_head]`), computing what the options
describe from there (RoPE, the mask, the scale, the softmax, the weighted sum, the merge of the heads). Each
stream's projections and qk-norm, done before the join, are the code's; the line-up compares from the joined
q, k, v up to the merge of the heads, and the catalog's experiments rerun that core.

Read from the data flow alone (never names or widths): the scores' two operands and the pattern's partner
(flow.operands) each computed from a `cat` of at least two tensors that the inputs reach (not parameters or
constants: a learned null key is no stream), each from a projection of its own (one projection's output split into
a prefix and the rest, EVA-02's cls token kept aside from RoPE, and joined back is one stream), along one axis, the
same for all three. Where the names the code
binds the joined keys and values to say the other roles than their use (`key = torch.cat(..)` handed as the values),
the names hold them: a swap is a mistake, never a convention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnscope.usertrace.scoreaxes import MOVES

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from attnscope.usertrace.record import Record

JOINS = ("cat", "concat", "concatenate")


@dataclass(frozen=True)
class Joined:
    """The code's joined q, k and v: the `cat` records, the token axis each joins on, the streams' token counts."""

    q: Record
    k: Record
    v: Record
    axes: tuple[int, int, int]
    parts: tuple[int, ...]  # each stream's tokens, in the order joined
    # the joined keys and values as the code names them (`key = torch.cat(..)`), which its attention then uses the
    # other way round (`sdpa(query, value, key)`): the reference holds them by their names, and the line-up shows the
    # swap, which the catalog names by experiment
    swapped: bool = False

    @property
    def n(self) -> int:
        return int(sum(self.parts))

    def merged(self, n_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """q, k, v as `[n_batch, n, n_head·d_head]`, the layout the reference's identity projections read; None where
        a joined tensor's layout is not read (heads neither beside the tokens nor merged)."""
        out = [_merged(r.tensor, axis, n_head) for r, axis in zip((self.q, self.k, self.v), self.axes, strict=True)]
        if any(t is None for t in out):
            return None
        q, k, v = out
        assert q is not None and k is not None and v is not None
        return q, k, v

    def note(self, each: str = "") -> str:
        """The note; `each`: how each stream's own q, k and v were compared before the join (jointstreams.said),
        where they were."""
        lines = sorted({self.q.line, self.k.line, self.v.line})
        at = ", ".join(str(line) for line in lines)
        streams = " + ".join(str(p) for p in self.parts)
        rest = (f", and {each} (each stream's output projection is not compared)" if each else
                " (each stream's projections, norms and output projection are not compared)")
        return (f"joint attention: your code joins {len(self.parts)} streams along the tokens ({streams} tokens; "
                f"line{'s' if len(lines) > 1 else ''} {at}: {self.q.call}), each with projections of its own, "
                "which no reference of four projections holds: the reference starts from your joined q, k and v "
                f"and is compared from there up to the merge of the heads{rest}")


def find(records: list[Record], params: dict[str, Any]) -> Joined | None:
    """The code's joined q, k and v where its attention reads streams joined along the tokens; None otherwise (a
    decode step's cache joins keys and values alone, never the queries)."""
    from attnscope.usertrace.flow import operands

    found = operands(records)
    if found is None:
        return None
    joins = [_join_above(records[i], records, params) for i in found[:3]]
    if any(j is None for j in joins):
        return None
    (q, qa, qp), (k, ka, kp), (v, va, vp) = joins  # type: ignore[misc]
    if not qp == kp == vp:
        return None
    if _named(records, k) == "v" and _named(records, v) == "k":  # `sdpa(query, value, key)`: a swap, never a role
        return Joined(q, v, k, (qa, va, ka), qp, swapped=True)
    return Joined(q, k, v, (qa, ka, va), qp)


def _named(records: list[Record], joined: Record) -> str | None:
    """The role the name the code binds a joined tensor to says (`key = torch.cat([key, ...])`), else None."""
    from attnscope.usertrace.reference import role_of
    from attnscope.usertrace.words import bound_name

    name = bound_name(records, joined)
    return role_of(name) if name is not None else None


def _join_above(operand: Record, records: list[Record], params: dict[str, Any]
                ) -> tuple[Record, int, tuple[int, ...]] | None:
    """The last `cat` the operand is computed from that joins, along one axis other than the features' (the last:
    rotate_half's halves), two or more tensors the inputs reach and holds as many values as the operand (the same
    tokens and heads, in any layout)."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.flow import projection_above
    from attnscope.usertrace.reference import parameters_read

    above = sorted(ancestors(operand, records) | {operand.index}, reverse=True)
    for index in above:
        r = records[index]
        if r.func.split(".")[-1] not in JOINS or r.tensor.numel() != operand.tensor.numel():
            continue
        given = [records[i] for kind, value in r.args if kind == "list" for k, i in value if k == "rec"]
        fed = [g for g in given if parameters_read(g.index, records, params) is None]
        if len(given) < 2 or len(fed) < 2:
            continue
        if any(records[i].style == "linear" and r.index in ancestors(records[i], records) for i in above):
            return None  # the inputs joined before the projections read them (CogVideoX's): no streams of their own
        if len({getattr(projection_above(records, g.index), "index", None) for g in fed}) < len(fed):
            continue  # one projection's output split (a cls token kept aside from RoPE) and joined back: one stream
        axis = _axis(r.tensor, [g.tensor for g in given])
        if axis is not None and axis != r.tensor.dim() - 1:  # the last axis joins features (rotate_half's halves)
            return r, axis, tuple(int(g.tensor.shape[axis]) for g in given)
    return None


def _axis(out: torch.Tensor, parts: list[torch.Tensor]) -> int | None:
    """The axis `parts` were joined on to make `out` (the sizes add up there, every other axis the same)."""
    if any(p.dim() != out.dim() for p in parts):
        return None
    for axis in range(out.dim()):
        others = [a for a in range(out.dim()) if a != axis]
        if sum(int(p.shape[axis]) for p in parts) == out.shape[axis] and all(
                p.shape[a] == out.shape[a] for p in parts for a in others):
            return axis
    return None


def _merged(t: torch.Tensor, axis: int, n_head: int) -> torch.Tensor | None:
    """A joined tensor as `[n_batch, n, n_head·d_head]`: `[n_batch, n_head, n, d_head]` (joined on axis 2),
    `[n_batch, n, n_head, d_head]` and `[n_batch, n, n_head·d_head]` (on axis 1); keys and values of fewer heads
    that n_head shares out (grouped-query) alike."""
    if t.dim() == 4 and axis == 2 and n_head % t.shape[1] == 0:
        return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)
    if t.dim() == 4 and axis == 1 and n_head % t.shape[2] == 0:
        return t.reshape(t.shape[0], t.shape[1], -1)
    if t.dim() == 3 and axis == 1 and t.shape[2] % n_head == 0:
        return t
    return None


def streams(records: list[Record], params: dict[str, Any], inputs: Sequence[str]) -> bool:
    """Whether the code joins streams that each of `inputs` (the forward's tensors, by label) reaches: a memory
    parameter fed as a second stream of joint attention (SD3's `encoder_hidden_states`) rather than as the keys'
    and values' alone."""
    from attnscope.usertrace.align import ancestors

    if joined_inputs(records, inputs) is not None:
        return True
    joined = find(records, params)
    if joined is None:
        return False
    above = {i for r in (joined.q, joined.k, joined.v) for i in ancestors(r, records)}
    read = {value for i in above for kind, value in records[i].args if kind == "text"}
    return all(name in read for name in inputs)


def joined_inputs(records: list[Record], inputs: Sequence[str]) -> Record | None:
    """The tensor every one of the code's q, k and v projections reads where it is the forward's inputs (at least two
    of `inputs`, by label) joined along the tokens before them (CogVideoX's `torch.cat([encoder_hidden_states,
    hidden_states], dim=1)`, then `to_q`, `to_k`, `to_v`): one stream made of several, read as the reference's input.
    None otherwise."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.flow import operands

    found = operands(records)
    if found is None:
        return None
    read: set[int] = set()
    for index in found[:3]:
        above = ancestors(records[index], records) | {index}
        calls = [records[i] for i in sorted(above, reverse=True) if records[i].style == "linear"]
        if not calls or len(calls[0].args) < 2 or calls[0].args[1][0] != "rec":
            return None
        read.add(calls[0].args[1][1])
    if len(read) != 1:
        return None
    joined = records[read.pop()]
    listed = [value for kind, value in joined.args if kind == "list"]
    labels = [value for kind, value in listed[0] if kind == "text"] if len(listed) == 1 else []
    axis = [value for kind, value in joined.args if kind == "text" and value.removeprefix("dim=") in ("1", "-2")]
    if joined.func.split(".")[-1] not in JOINS or joined.tensor.dim() != 3 or len(labels) != len(listed[0]) \
            or len(set(labels) & set(inputs)) < 2 or not axis:
        return None
    return joined


def apply_joined(records: list[Record], inputs: Any) -> bool:
    """`inputs` with the forward's inputs joined along the tokens before every projection (joined_inputs) as the
    reference's input for q, k and v, n_Q = n_K their length, and the note that says so; False (nothing changed)
    where they are not, or the mask does not fit that length."""
    joined = joined_inputs(records, list(inputs.tensors))
    if joined is None or inputs.own or inputs.layout != "row" or inputs.cache is not None:
        return False
    n = int(joined.tensor.shape[1])
    mask = inputs.mask
    if mask is not None and mask.dim() >= 2 and (mask.shape[-2] not in (1, n) or mask.shape[-1] not in (1, n)):
        return False
    tensor = joined.tensor.detach()
    inputs.own = {"Q": tensor, "K": tensor, "V": tensor}
    inputs.own_from = "joined"
    inputs.sizes["n_Q"], inputs.sizes["n_K"] = n, n
    inputs.notes.append(f"joint attention: your code joins its inputs along the tokens before its projections read "
                        f"them (line {joined.line}: {joined.details.get('op', joined.call)}), n = {n}; the reference "
                        "reads the joined tensor as its input, self-attention over all the tokens")
    return True


def memory_note(memory: str, first: str, n: str) -> str:
    """The note for a second stream fed to a parameter that defaults to None."""
    return (f"{memory}: a second stream your code joins with {first} along the tokens (joint attention, {n} tokens "
            "of its own), read from its data flow; None leaves it out")


def merge_row(rows: list[Any], trace: Any, records: list[Record]) -> None:
    """The reference's `x` (the merge of the heads: its output projection is the identity) lined up with the code's
    own merge: the first tensor of x's shape the code makes from its attention's output. The line-up finds x in any
    layout (x equals x_rsh2); a merge that reads the heads in another order (a reshape without the transpose back)
    is a divergence there, as a returned tensor is for a module compared up to its merge. Also for a module whose
    output projection reads the merge beside other features (reference.merge_only)."""
    from attnscope.usertrace.align import ancestors, tolerance
    from attnscope.usertrace.flow import operands

    found = operands(records)
    row = next((r for r in rows if r.reference == "x"), None)
    if found is None or found[3] is None or row is None or "x" not in trace:
        return
    x = trace["x"]
    made = next((r for r in records if r.index > found[3] and tuple(r.tensor.shape) == tuple(x.shape)
                 and r.tensor.is_floating_point() and found[3] in ancestors(r, records)), None)
    if made is None:
        return
    diff = float((made.tensor.double() - x.double()).abs().max())
    if diff > tolerance(x) or row.record is None or row.status not in ("equal", "permuted"):
        row.record, row.status, row.max_abs_diff, row.layout, row.order = made, "differs", diff, "", None
        row.merged, row.split = False, None
        if diff <= tolerance(x):
            row.status = "equal"


@dataclass(frozen=True)
class SplitFault:
    """A stream whose heads the code splits by a view without the transpose, found before the join."""

    role: str  # "Q", "K" or "V"
    split: Record  # the code's tensor, [n_batch, n_head, n, d_head] read straight from the projection's output
    projection: Record  # the stream's projection output it was viewed from, [n_batch, n, n_head·d_head]
    experiment: str = "heads.split_without_permute"

    def words(self) -> tuple[str, str]:
        """The diagnosis and the evidence."""
        p, s = self.projection, self.split
        diagnosis = (f"heads split without the transpose: your {s.label} (line {s.line}) holds your {p.label} (line "
                     f"{p.line}), a stream's {self.role} [n_batch, n, n_head·d_head], viewed straight as [n_batch, "
                     "n_head, n, d_head], so each head holds a run of positions of several heads, not one head of "
                     "every position; view it as [n_batch, n, n_head, d_head] and .transpose(1, 2)")
        evidence = (f"by experiment: your {p.label} (line {p.line}) viewed straight as {list(s.tensor.shape)} gives "
                    f"back your "
                    f"{s.label} (line {s.line}) exactly, where the split with the transpose does not")
        return diagnosis, evidence


def split_fault(records: list[Record], joined: Joined, n_head: int) -> SplitFault | None:
    """The first stream whose q, k or v the code splits into heads by viewing its projection's output `[n_batch, n,
    n_head·d_head]` straight as `[n_batch, n_head, n, d_head]` before the join: the reference starts from the joined
    tensors, so such a split is found here, by experiment (the straight view gives the code's tensor back exactly,
    the view with the transpose does not); None where every stream's split reads its projection's tokens whole.
    Where a stream has as many tokens as heads, `[n_batch, n, n_head, d_head]` has the shape of `[n_batch, n_head,
    n, d_head]`: the straight view is then the right one where the code holds the tokens on axis 1 (_tokens_axis)."""
    import torch

    from attnscope.usertrace.fused import nearest_ancestors

    for role, cat, axis in zip("QKV", (joined.q, joined.k, joined.v), joined.axes, strict=True):
        for part in (records[i] for kind, value in cat.args if kind == "list" for k, i in value if k == "rec"):
            for r in nearest_ancestors(records, part.index):
                made = next((records[p] for p in r.parents if records[p].style == "linear"), None)
                t = r.tensor
                if made is None or t.dim() != 4 or t.shape[1] != n_head or made.tensor.dim() != 3 \
                        or made.tensor.numel() != t.numel() or made.tensor.shape[1] != t.shape[2]:
                    continue
                if t.shape[1] == t.shape[2] and _tokens_axis(records, r, part, axis) == 1:
                    break  # [n_batch, n, n_head, d_head] as the code holds it: the straight view is the right one
                b, n, _ = made.tensor.shape
                source = made.tensor.detach()
                right = source.reshape(b, n, n_head, -1).transpose(1, 2)
                if torch.equal(source.reshape(t.shape), t.detach()) and not torch.equal(right, t.detach()):
                    return SplitFault(role, r, made)
                break
    return None


SWAPS = (*MOVES, "moveaxis")  # the ops that move axes (scoreaxes.MOVES), torch.moveaxis among them


def _tokens_axis(records: list[Record], r: Record, part: Record, axis: int) -> int:
    """The axis of `r` (4-D, made before the join) that holds the tokens: the join's `axis` (1 or 2) where no op
    between them moves an axis (a norm, a cast or a view keeps the layout), else the other of the two."""
    from attnscope.usertrace.align import ancestors

    between = [i for i in ancestors(part, records) | {part.index}
               if i > r.index and r.index in ancestors(records[i], records)]
    moved = any(records[i].func.split(".")[-1] in SWAPS for i in between)
    return 3 - axis if moved and axis in (1, 2) else axis


def heads(joined: Joined, n_head: int | None) -> int | None:
    """The head count: the module's where it says one, else the joined queries' heads axis (`[n_batch, n_head, n,
    d_head]`)."""
    if n_head is not None:
        return n_head
    q = joined.q.tensor
    return int(q.shape[1]) if q.dim() == 4 and joined.axes[0] == 2 else None
