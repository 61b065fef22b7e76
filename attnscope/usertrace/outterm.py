"""A term the code adds to its attention's output that no option describes, beside the pattern times V: Shaw et
al.'s relative values `attn · rel_v[j − i]` (an einsum, or the pattern made time-major times the table), a learned
output bias per query position, the pattern averaging a table of key positions (`attn @ pos_v[:n_K]`).

The module's own, as a term on its scores is (ownterm.py): read off the data flow, an add one of whose operands is
the code's `attn @ v` (the tensor the line-up pairs with x_raw, or a rearranging of it) and the other computed from
a tensor of the module's own that no projection holds (a table, a bias) or the positions (an arange). The term is
taken from the run, the sum less `attn @ v`, in the reference's x_raw layout, and the reference adds it to its
x_raw (the heads then merged and projected as before), so every step is still compared, and a rerun of a catalog
mistake upstream (the scale, the mask, the softmax's axis) adds it too: the code's term was made from the code's
own pattern, which the mistake's rerun reproduces.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace.align import REARRANGING, Layout, ancestors, layouts

if TYPE_CHECKING:
    from attnscope.trace import Trace
    from attnscope.usertrace.record import Record

ADDS = ("add", "__add__", "__radd__")
TAIL = ("x_raw", "x_rsh1", "x_rsh2", "x")


@dataclass
class OutTerm:
    tensor: torch.Tensor  # the term as the code adds it, in the reference's x_raw layout [n_batch, n_head, n_Q, d]
    note: str
    index: int = -1  # the record of the code's add
    queries: bool = False  # the term is the code's queries, head by head: a rerun that changes them adds them changed


def found(module: Any, records: list[Record], lined: Any) -> OutTerm | None:
    """The term the code adds to its `attn @ v` (the record the line-up `lined` pairs with x_raw), in the reference's
    x_raw layout, and the note that says it; None where the code adds none."""
    from attnscope.usertrace.ownterm import extra_params, own_source

    trace = lined.trace
    row = next((r for r in lined.rows if r.reference == "x_raw" and r.record is not None and r.order is not None
                and r.status in ("equal", "permuted", "differs")), None)
    pattern = next((r.record for r in lined.rows if r.reference == "attention" and r.record is not None), None)
    if trace is None or row is None or pattern is None or "x_raw" not in trace:
        return None
    shape = tuple(trace["x_raw"].shape)
    made = _attn_v(row.record, records)
    held = Layout(row.order, row.merged, row.split).undo(made.tensor, shape).double()  # made, as x_raw lays it out
    paired = {r.reference: r.record for r in lined.rows if r.record is not None}
    extra = extra_params(module, records, paired, buffers=True)
    before = ancestors(pattern, records) | {pattern.index}  # the scores' own term is read there, not here
    for record, given, moved in downstream(made, records):
        if record.func not in ADDS or not record.tensor.is_floating_point():
            continue
        mine = [v for v in given if v in moved]
        if len(mine) != 1 or tuple(record.tensor.shape) != tuple(records[mine[0]].tensor.shape):
            continue
        others = [a for a in record.args if a != ("rec", mine[0])]
        up = set().union(*(ancestors(records[v], records) | {v} for k, v in others if k == "rec")) - before
        if len(others) != 1 or made.index in up or (others[0][0] == "text" and others[0][1] not in extra):
            continue
        operand = records[mine[0]]
        layout = _layout_of(operand, held, shape)
        if layout is None:
            continue
        term = layout.undo(record.tensor, shape).double() - layout.undo(operand.tensor, shape).double()
        if not bool(torch.isfinite(term).any()):
            continue
        # the queries themselves added back, head by head (MViTv2's residual pooling, `x + q` after `attn @ v`)
        # or, by the data flow, the very queries its scores read, where a mistake upstream (heads split the wrong
        # way) makes them differ from the reference's: the reference adds its own queries, a rerun its changed ones
        queries = others[0][0] == "rec" and made.index not in ancestors(records[others[0][1]], records) \
            and (_the_queries(term, trace) or _scored_queries(others[0][1], records, trace, shape))
        if queries and not _the_queries(term, trace):
            term = trace["Q_split"].double()
        if others[0][0] == "rec" and not queries and not own_source(up, records, extra):
            continue
        # a query that sees no key (NaN in the code's pattern, its row left out of the comparison): no term there
        term = torch.where(torch.isfinite(term), term, 0.0)
        note = _queries_note(record, records[others[0][1]]) if queries \
            else _note(record, others[0], records, extra, before)
        return OutTerm(term.float(), note, record.index, queries)
    return None


def _attn_v(paired: Record, records: list[Record]) -> Record:
    """The code's `attn @ v`: the record the line-up paired with x_raw, or, where that is the code's add of a term
    to it (its values then matching no step: a mistake upstream), the add's operand made from pattern and V."""
    from attnscope.usertrace.flow import operands

    ops = operands(records)
    av = None if ops is None else ops[3]
    if av is not None and paired.func in ADDS and av in paired.parents \
            and tuple(records[av].tensor.shape) == tuple(paired.tensor.shape):
        return records[av]
    return paired


def _scored_queries(index: int, records: list[Record], trace: Trace, shape: tuple[int, ...]) -> bool:
    """Whether record `index` is the queries the code's scores read (their left operand, by the data flow) and the
    reference's queries, head by head, are as wide as its x_raw."""
    from attnscope.usertrace.flow import operands

    ops = operands(records)
    return ops is not None and ops[0] == index and "Q_split" in trace and tuple(trace["Q_split"].shape) == shape


def downstream(made: Record, records: list[Record]) -> Iterator[tuple[Record, list[int], set[int]]]:
    """Each op after `made` (the code's `attn @ v`) that only rearranging ops do not explain, with the records it
    reads and, so far, `made` and its rearrangings (the heads moved back, merged): where an op on them is sought."""
    moved = {made.index}
    for record in records[made.index + 1:]:
        given = [v for k, v in record.args if k == "rec"]
        if record.func in REARRANGING and given[:1] and given[0] in moved \
                and record.tensor.numel() == made.tensor.numel():
            moved.add(record.index)
            continue
        yield record, given, moved


def _layout_of(operand: Record, held: torch.Tensor, shape: tuple[int, ...]) -> Layout | None:
    """How `operand` (the code's `attn @ v`, or that rearranged) lays out the reference's x_raw: the layout under
    which it holds `held`'s values."""
    for layout in layouts(shape, tuple(operand.tensor.shape)):
        if torch.equal(layout.undo(operand.tensor, shape).double(), held):
            return layout
    return None


def _the_queries(term: torch.Tensor, trace: Trace) -> bool:
    """Whether the term the code adds to its `attn @ v` is the reference's queries, head by head (its `Q_split`,
    `[n_batch, n_head, n_Q, d_head]`, d_head as wide as the values')."""
    if "Q_split" not in trace:
        return False
    queries = trace["Q_split"].double()
    return tuple(queries.shape) == tuple(term.shape) and bool(torch.allclose(term, queries, rtol=1e-4, atol=1e-5))


def _queries_note(record: Record, queries: Record) -> str:
    made = record.details.get("op", record.label)
    return (f"your code adds its queries, head by head, to the attention's output (line {record.line}: {made}; "
            f"{queries.label} from line {queries.line}, as MViTv2's residual pooling adds its pooled queries): the "
            "reference adds its own queries too, to its x_raw; a convention, not a mistake")


def _note(record: Record, other: tuple[str, Any], records: list[Record], extra: set[str], before: set[int]) -> str:
    from attnscope.usertrace.ownterm import source_words

    made = record.details.get("op", record.label)
    if other[0] == "rec":
        term = records[other[1]]
        reads = "your attention weights and " if any(i in before for i in ancestors(term, records)) else ""
        said = f"{term.label} from {reads}{source_words(term, records, extra, before)}"
    else:
        said = f"{other[1]}, a parameter of your own"
    return (f"your code adds a term of its own to the attention's output (line {record.line}: {made}; {said}, as "
            "Shaw et al.'s relative values, or a position's own bias, are): the reference adds it too, to its x_raw, "
            "as your run computes it; a convention, not a mistake")


def folded(trace: Trace, term: torch.Tensor, reference: Any) -> Trace:
    """The reference's run with the code's term added to its x_raw, the heads then merged and projected again
    (attention/stages.merge, as the reference's MultiHeadAttention does)."""
    from attnscope.attention.stages import merge
    from attnscope.trace import Trace

    if any(name not in trace for name in TAIL) or tuple(trace["x_raw"].shape) != tuple(term.shape):
        return trace
    out = Trace(notes=list(trace.notes))
    for step in trace.steps:
        if step.name not in TAIL:
            out.add_step(step)
    old = trace.step("x_raw")
    x_raw = out.add("x_raw", old.tensor + term.to(old.tensor.dtype), old.dims, f"{old.op} + your own term",
                    old.work, inputs=old.inputs)
    with torch.no_grad():
        merge(out, x_raw, reference.W_o, reference.width("n_head"))
    return out


def from_pattern(record: Record, pattern: int | None, records: list[Record], output: int | None = None) -> bool:
    """Whether `record` is computed from the attention weights (`pattern`, their record's index) and not from the
    attention's output (`output`, the record of `attn @ v`): a term of the attention's own on its output (Shaw's
    `attn · a_V`), never a block's residual joined after it; a layer on the output (the Set Transformer's
    `relu(fc_o(O))` added to O) reads the pattern through the output and is the block's."""
    if pattern is None:
        return False
    above = ancestors(record, records)
    return (record.index == pattern or pattern in above) and (
        output is None or (record.index != output and output not in above))
