"""A term the code adds to its scores that no option describes, computed from its own queries (or keys) and a learned
table or the positions: Shaw et al.'s relative keys `q · rel_k[j − i]`, Transformer-XL's `q · R` (with its u and v
biases), DeBERTa's c2p and p2c. The module's own, as its position bias is (ownbias.py), but drawn from the inputs.

Read off the data flow and the numbers: an add on the way to the softmax one of whose operands is the content scores
`q · kᵀ` (in some layout, times 1 before the scale or times the code's scale after it) and the other computed from the
code's queries or keys and a parameter of no projection (a table, a bias) or the positions (an arange). Where the
content product is made from queries with a learned bias added (Transformer-XL's `(q + u) · kᵀ`), that product is
found by recomputing it in the reference's layout, and the term is the sum less `q · kᵀ`. The term is taken from the
run in the reference's scores layout; the reference adds it where the code does, so the scale, the mask and the
softmax are still compared (and a catalog mistake is still named by experiment, lineup.line_up keeping the term).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace.align import ancestors, factor_of, layouts, tolerance

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record

ADDS = ("add", "__add__", "__radd__", "add_", "__iadd__")
CONTENT_Q = ("Q_rot", "Q_normed", "Q_split", "Q_feat", "Q")
CONTENT_K = ("K_rep", "K_cat", "K_rot", "K_normed", "K_split", "K_feat", "K")
PROJECTIONS = ("Q_feat", "K_feat", "V_feat", "x")


@dataclass
class Term:
    tensor: torch.Tensor  # the term as the code adds it, in the reference's scores layout [.., n_Q, n_K]
    before_scale: bool  # added to q · kᵀ before the scale (Shaw's, Transformer-XL's), else to the scaled scores
    record: Record  # the add
    note: str
    products: int = 1  # the products of queries or keys with a table it sums (DeBERTa's c2p and p2c: 2)
    width: int | None = None  # the width the scores contract over, where the queries and keys join parts of their
    # own per head (headparts.py: Conditional DETR's): the reference's scale is 1/√width unless --scale says one


def added_term(module: Any, records: list[Record], lined: Any) -> Term | Record | None:
    """The Term the line-up `lined` (lined.LineUp) says; or, where the code adds such a term that cannot be placed
    (its content product found in no layout), the add itself; None where the code adds none."""
    trace, spec = lined.trace, lined.spec
    if trace is None or spec is None or "scores" not in trace or spec.softcap is not None or spec.layout == "col":
        return None
    scores = trace["scores"].double()
    d_head = d_head_of(trace)
    if d_head is None:
        return None
    scale = spec.scale if spec.scale is not None else 1 / math.sqrt(d_head)
    content = scores / scale  # q · kᵀ as the reference computes it
    rows = {row.reference: row for row in lined.rows if row.record is not None and row.status in ("equal", "permuted")}
    found = _found(module, records, trace, rows, content, None)
    own = _own_content(lined, trace, records, rows) if not isinstance(found, Term) else None
    if own is not None:  # the line-up diverges at the queries (keys) the code's term is made from: theirs
        rows = {**rows, own[0]: next(row for row in lined.rows if row.reference == own[0])}
        again = _found(module, records, trace, rows, own[1], own[2:])
        if isinstance(again, Term):
            return again
    split = _split_content(lined, trace, records) if not isinstance(found, Term) else None
    if split is not None:  # a fused projection's queries split otherwise, the term made from them: theirs
        again = _found(module, records, trace, {**rows, **split[0]}, split[1], None)
        if isinstance(again, Term):
            return again
    swapped = _swapped_content(trace, rows) if not isinstance(found, Term) else None
    if swapped is not None:  # the code's scores read the tensor lined up with the values (k and v swapped)
        again = _found(module, records, trace, {**rows, swapped[0]: rows[swapped[1]]}, *swapped[2:])
        if isinstance(again, Term):
            return again
    if found is None:  # no term added: parts of the code's own joined to its queries and keys per head
        from attnscope.usertrace.headparts import joined

        parts = joined(records, trace, before_softmax(records))
        if parts is not None:
            return Term(parts.term.float(), True, parts.record, parts.note, 1, parts.width)
    return found


def _swapped_content(trace: Any, rows: dict[str, Any]
                     ) -> tuple[str, str, torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None:
    """Where the values are laid out as the keys are: the keys' step, the values', q · vᵀ in the reference's layout
    (the content product of code whose scores read its values, keys and values swapped) and the queries and values
    it is made from; None elsewhere."""
    q_step = next((n for n in ("Q_rot", "Q_normed", "Q_split") if n in rows and n in trace), None)
    k_step = next((n for n in ("K_rep", "K_cat", "K_rot", "K_normed", "K_split") if n in trace), None)
    v_step = next((n for n in ("V_rep", "V_cat", "V_split") if n in rows and n in trace), None)
    if q_step is None or k_step is None or v_step is None or trace[v_step].shape != trace[k_step].shape:
        return None
    queries, values = trace[q_step].double(), trace[v_step].double()
    if queries.dim() != values.dim() or queries.shape[:-2] != values.shape[:-2] \
            or queries.shape[-1] != values.shape[-1]:
        return None  # held in other layouts (grouped heads, a split the code does otherwise): no product to make
    return k_step, v_step, queries @ values.transpose(-2, -1), (queries, values)


def _found(module: Any, records: list[Record], trace: Any, rows: dict[str, Any], content: torch.Tensor,
           own: tuple[torch.Tensor, torch.Tensor] | None) -> Term | Record | None:
    """added_term's Term, given the content product q · kᵀ in the reference's layout and the rows lined up (with
    `own`, the code's own queries and keys where they diverge)."""
    paired = {name: row.record for name, row in rows.items() if row.record is not None}
    q_side = {r.index for n, r in paired.items() if n in CONTENT_Q}
    k_side = {r.index for n, r in paired.items() if n in CONTENT_K}
    if not q_side or not k_side:
        return None
    extra = extra_params(module, records, paired, buffers=True)
    softmaxed = before_softmax(records)
    unplaced = None
    for record in records:
        if record.func not in ADDS or record.index not in softmaxed or not record.tensor.is_floating_point() \
                or record.tensor.numel() != content.numel():
            continue
        operands = [records[p] for p in _operands(record)]
        if len(operands) != 2:
            continue
        for x, y in (operands, operands[::-1]):
            up_x, up_y = ancestors(x, records) | {x.index}, ancestors(y, records) | {y.index}
            # a mask made from the scores (full_like(scores, -inf).triu(1)) reads them: no term
            if not (up_x & q_side and up_x & k_side) or not (up_y & (q_side | k_side)) or x.index in up_y \
                    or not own_source(up_y, records, extra):
                continue
            unplaced = unplaced or record
            more = _more_terms(record, records, softmaxed, extra)
            total = more[-1] if more else record
            said = source_words(total, records, extra, up_x)  # what the term reads beside q · kᵀ
            # the terms as the code adds them, each of the content's shape, else the sum less q · kᵀ
            alike = all(tuple(t.tensor.shape) == tuple(x.tensor.shape) for t in more[:-1] if t is not None)
            placed = _placed(x, y, total, content, records, trace, rows, own) if alike else None
            if placed is None:
                placed = _viewed(x, total, content, records)
                if placed is None:
                    continue
                more = []  # the sum less q · kᵀ holds every term
            term, factor = placed
            if more and tuple(y.tensor.shape) == tuple(x.tensor.shape):  # scores = q · kᵀ + c2p + p2c
                term = term + sum(_laid(t, x, content) for t in more[:-1] if t is not None)
            if not bool(torch.isfinite(term).all()):  # a mask, not a term
                continue
            before = math.isclose(factor, 1.0, rel_tol=1e-3)
            parts = [y, *(t for t in more[:-1] if t is not None)]
            return Term(term.float(), before, record, _note(record, y, said, before),
                        _products(parts, records, q_side | k_side, extra))
    return unplaced


def _own_content(lined: Any, trace: Any, records: list[Record], rows: dict[str, Any]
                 ) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Where the line-up diverges at the queries the scores read (ESPnet's heads split without the transpose, its
    relative term then made from those queries too): that step, q · kᵀ from the code's own queries and keys in the
    reference's layout, and those queries; None elsewhere. The term the code adds is then the sum less that product,
    so a rerun of the mistake, adding it, gives the code's scores back."""
    divergence = lined.divergence
    q_step = next((n for n in ("Q_rot", "Q_normed", "Q_split") if n in trace), None)
    k_step = next((n for n in ("K_rep", "K_cat", "K_rot", "K_normed", "K_split") if n in trace), None)
    if divergence is None or q_step is None or k_step is None or divergence.reference != q_step:
        return None
    row = next((r for r in lined.rows if r.reference == q_step), None)
    shape = tuple(trace[q_step].shape)
    if row is None or row.record is None or tuple(row.record.tensor.shape) != shape:
        return None
    keys = _own_keys(records, rows, trace, k_step, row.record)
    if keys is None:
        return None
    queries = row.record.tensor.double()
    return q_step, queries @ keys.transpose(-2, -1), queries, keys


def _split_content(lined: Any, trace: Any, records: list[Record]) -> tuple[dict[str, Any], torch.Tensor] | None:
    """Where the line-up diverges at the queries and no step of the code lines up with them (a fused projection split
    otherwise, SAM's qkv permuted without moving the heads before the tokens): the code's queries and keys as rows,
    and its own q · kᵀ in the reference's layout (ownsplit.py); None elsewhere."""
    from types import SimpleNamespace

    from attnscope.usertrace.ownsplit import own_product

    divergence = lined.divergence
    if divergence is None or divergence.reference not in ("Q_feat", "Q_split") or "Q_split" not in trace:
        return None
    softmaxed = before_softmax(records)
    for record in records:
        if record.func not in ADDS or record.index not in softmaxed or not record.tensor.is_floating_point():
            continue
        found = own_product(records, trace, record)
        if found is not None:
            queries, keys, content = found
            return {"Q_split": SimpleNamespace(record=queries), "K_split": SimpleNamespace(record=keys)}, content
    return None


def _own_keys(records: list[Record], rows: dict[str, Any], trace: Any, k_step: str, queries: Record
              ) -> torch.Tensor | None:
    """The keys the code's scores read, in the reference's layout: the last tensor of that very shape made from the
    keys' projection (the reference's keys where the code holds them so) and not from the queries; None where
    none is."""
    projected = next((rows[n].record for n in ("K_feat", "K") if n in rows), None)
    if projected is None:
        return None
    shape = tuple(trace[k_step].shape)
    q_up = ancestors(queries, records) | {queries.index}
    found = [r for r in records if tuple(r.tensor.shape) == shape and r.tensor.is_floating_point()
             and projected.index in ancestors(r, records) and not (ancestors(r, records) & q_up)]
    return found[-1].tensor.double() if found else None


def _products(parts: list[Record], records: list[Record], sides: set[int], extra: set[str]) -> int:
    """How many products of the queries or keys with a table of the module's own the term's parts sum."""
    from attnscope.usertrace.record import MATMULS

    up = set().union(*(ancestors(p, records) | {p.index} for p in parts))
    found = 0
    for i in up:
        r = records[i]
        if r.func.split(".")[-1] not in (*MATMULS, "einsum"):
            continue
        sides_of = [ancestors(records[g], records) | {g} for g in _operands(r)]
        if len(sides_of) == 2 and any(s & sides for s in sides_of) \
                and any(own_source(s, records, extra) and not s & sides for s in sides_of):
            found += 1
    return max(found, 1)


def _more_terms(record: Record, records: list[Record], softmaxed: set[int], extra: set[str]) -> list[Any]:
    """The further terms the code adds to the sum `record` on the way to its softmax (`q · kᵀ + c2p + p2c`), each
    made from tensors of its own and not from the sum, then the last sum: [term, ..., None, last sum]; [] where
    none."""
    total = record
    found: list[Record] = []
    for r in records[record.index + 1:]:
        given = _operands(r)
        if r.func not in ADDS or r.index not in softmaxed or len(given) != 2 or total.index not in given \
                or tuple(r.tensor.shape) != tuple(total.tensor.shape):
            continue
        other = records[given[1] if given[0] == total.index else given[0]]
        up = ancestors(other, records) | {other.index}
        if total.index in up or not _broadcasts(tuple(other.tensor.shape), tuple(total.tensor.shape)) \
                or not own_source(up, records, extra):
            break
        total, found = r, [*found, other]
    return [*found, None, total] if found else []


def _broadcasts(shape: tuple[int, ...], into: tuple[int, ...]) -> bool:
    """Whether a tensor of `shape` broadcasts to `into` without widening it (SAM's rel_h[:, :, :, :, None])."""
    return len(shape) <= len(into) and all(a in (1, b) for a, b in zip(shape[::-1], into[::-1], strict=False))


RESHAPES = ("view", "reshape", "flatten", "unflatten", "contiguous", "view_as", "reshape_as", "clone")


def _viewed(x: Record, total: Record, content: torch.Tensor, records: list[Record]
            ) -> tuple[torch.Tensor, float] | None:
    """The term where the code adds it to q · kᵀ viewed otherwise, values kept (SAM's and MViTv2's
    `attn.view(B, q_h, q_w, k_h, k_w) + rel_h[..., None] + rel_w[..., None, :]`), or in parts broadcast along it:
    `x`, the content operand, holds q · kᵀ in some layout (times 1, or the code's scale), or is a reshape of a
    tensor that does; the sum `total` less `x`, read back through that reshape (a reshape keeps the values' order)
    and that layout, is the term, whatever broadcast its parts were added with. None where `x` is no such tensor."""
    if tuple(total.tensor.shape) != tuple(x.tensor.shape):
        return None
    shape, source = tuple(content.shape), x
    while True:
        for layout in layouts(shape, tuple(source.tensor.shape)):
            factor = factor_of(layout.undo(source.tensor, shape).double(), content)
            if factor is not None:
                summed = (total.tensor.double() - x.tensor.double()).reshape(source.tensor.shape)
                return layout.undo(summed, shape), factor
        given = _operands(source)
        if source.func not in RESHAPES or len(given) != 1 or records[given[0]].tensor.numel() != x.tensor.numel():
            return None
        source = records[given[0]]


def _laid(term: Record, like: Record, content: torch.Tensor) -> torch.Tensor:
    """`term`, of `like`'s shape, in the reference's scores layout as `like` is."""
    shape = tuple(content.shape)
    for layout in layouts(shape, tuple(like.tensor.shape)):
        if factor_of(layout.undo(like.tensor, shape).double(), content) is not None:
            return layout.undo(term.tensor, shape).double()
    return torch.zeros(shape, dtype=torch.float64)


def _placed(x: Record, y: Record, total: Record, content: torch.Tensor, records: list[Record], trace: Any,
            rows: dict[str, Any], own: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, float] | None:
    """The term in the reference's layout and the factor the content operand carries (1 before the scale, the code's
    scale after it): `y` itself where `x` is the content times a number; else the sum less the content, where `x` is
    the content product of queries with a learned bias added (found by recomputing it)."""
    shape = tuple(content.shape)
    for layout in layouts(shape, tuple(x.tensor.shape)):
        user = layout.undo(x.tensor, shape).double()
        factor = factor_of(user, content)
        if factor is not None and tuple(y.tensor.shape) == tuple(x.tensor.shape):
            return layout.undo(y.tensor, shape).double(), factor
    biased = _biased_content(x, trace, records, rows, own)
    if biased is None:
        return None
    for layout in layouts(shape, tuple(total.tensor.shape)):
        factor = factor_of(layout.undo(x.tensor, shape).double(), biased)
        if factor is not None and math.isclose(factor, 1.0, rel_tol=1e-3):
            return layout.undo(total.tensor, shape).double() - content, 1.0
        if factor is not None:  # the queries scaled first (`q * scale`, the bias with them): the term after the scale
            return layout.undo(total.tensor, shape).double() - factor * content, factor
    return None


def _biased_content(x: Record, trace: Any, records: list[Record], rows: dict[str, Any],
                    own: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """`(q + u) · kᵀ` in the reference's layout, where `x` is made from the code's queries with something added
    (Transformer-XL's r_w_bias): that add, laid out as its operand that holds the reference's queries is (found by
    its numbers, whatever views lie between), times the reference's keys; None where `x` reads no such add."""
    q_step = next((n for n in ("Q_rot", "Q_normed", "Q_split") if n in rows and n in trace), None)
    k_step = next((n for n in ("K_rep", "K_cat", "K_rot", "K_normed", "K_split") if n in trace), None)
    if q_step is None or k_step is None or rows[q_step].record is None:
        return None
    q_rec, queries = rows[q_step].record, trace[q_step].double() if own is None else own[0]
    shape, keys = tuple(queries.shape), trace[k_step].double() if own is None else own[1]
    for index in sorted(ancestors(x, records)):
        added = records[index]
        if added.func not in ADDS or added.tensor.numel() != queries.numel():
            continue
        for p in _operands(added):
            operand = records[p]
            if p != q_rec.index and q_rec.index not in ancestors(operand, records):
                continue
            for layout in layouts(shape, tuple(operand.tensor.shape)):
                if tuple(added.tensor.shape) != tuple(operand.tensor.shape):
                    continue
                held = layout.undo(operand.tensor, shape).double()
                factor = 1.0 if float((held - queries).abs().max()) <= tolerance(queries.float()) \
                    else factor_of(held, queries)  # the queries scaled first (NeMo-like `q * d_k ** -0.5`)
                if factor is not None:
                    return layout.undo(added.tensor, shape).double() / factor @ keys.transpose(-2, -1)
    return None


def d_head_of(trace: Any) -> int | None:
    """d_head, read off the reference's run."""
    for name in ("Q_rot", "Q_normed", "Q_split", "Q"):
        if name in trace and trace[name].dim() >= 2:
            return int(trace[name].shape[-1])
    return None


def _operands(record: Record) -> list[int]:
    return [value for kind, value in record.args if kind == "rec"]


def before_softmax(records: list[Record]) -> set[int]:
    """The records some softmax is computed from."""
    from attnscope.usertrace.record import SOFTMAXES

    out: set[int] = set()
    for record in records:
        if record.func.split(".")[-1] in SOFTMAXES:
            out |= ancestors(record, records)
    return out


def extra_params(module: Any, records: list[Record], paired: dict[str, Record], buffers: bool = False) -> set[str]:
    """The module's own tensors no projection holds (a table of relative embeddings, Transformer-XL's biases and its
    r_net), each by its parameter's name and its module's: the projections are the Linear layers (or weights) the
    code's queries, keys and values are made with, and the one its output is. With `buffers`, its buffers too (a
    fixed table, Nezha's sinusoids of the clipped distances, is a term's table as a learned one is)."""
    from attnscope.usertrace.ownbias import arg_names

    if module is None or not isinstance(module, torch.nn.Module):
        return set()
    projected: set[str] = set()
    for step in PROJECTIONS:
        record = paired.get(step)
        if record is None:
            continue
        made = {record.index} if step == "x" else ancestors(record, records) | {record.index}
        projected |= {n for i in made if records[i].style == "linear" for n in arg_names(records[i].args)}
    held = [*module.named_parameters(), *(module.named_buffers() if buffers else ())]
    learned = {name for name, _ in held if name not in projected and name.rsplit(".", 1)[0] not in projected}
    return learned | {name.rsplit(".", 1)[0] for name in learned if "." in name}


def own_source(up: set[int], records: list[Record], extra: set[str]) -> bool:
    """Whether the records `up` read a tensor of the module's own no projection holds, or the positions (an
    arange)."""
    from attnscope.usertrace.ownbias import arg_names

    return any(records[i].func == "arange" or arg_names(records[i].args) & extra for i in up)


def source_words(record: Record, records: list[Record], extra: set[str], beside: Any = frozenset()) -> str:
    """The module's own tensors and the positions that `record` is computed from (where `beside` is not), in
    words."""
    from attnscope.usertrace.ownbias import arg_names

    up = (ancestors(record, records) | {record.index}) - beside
    sources = sorted({n for i in up for n in arg_names(records[i].args) & extra})
    sources = [n for n in sources if not any(n.startswith(o + ".") for o in sources)]
    positions = any(records[i].func == "arange" for i in up)
    if not sources:
        return "the positions" if positions else "tensors of its own"
    return ", ".join(sources[:3]) + (" and the positions" if positions else "")


def _note(record: Record, term: Record, sources: str, before: bool) -> str:
    where = "before the scale (the reference scales it with q · kᵀ)" if before else "after the scale"
    made = record.details.get("op", record.label)
    return (f"your code adds a term of its own to its scores (line {record.line}: {made}; {term.label} from your "
            f"queries or keys and {sources}, a relative-position term): the reference adds it too, {where}, as your "
            "run computes it; a convention, not a mistake")


OUTPUT_STEPS = ("x_raw", "x_rsh1", "x_rsh2", "x", "out")


def output_term(module: Any, records: list[Record], lined: Any) -> str | None:
    """The one line for a term the code adds to the attention's output that the reference has none of (Shaw et al.'s
    relative values, `attn · rel_v[j − i]`): an add after the pattern, both of whose operands are made from it, one
    of them with a table of the module's own or the positions; None where the divergence is elsewhere, named, or
    the code adds no such term."""
    first = lined.divergence
    if first is None or first.experiment is not None or first.reference not in OUTPUT_STEPS:
        return None
    pattern = next((row.record for row in lined.rows if row.reference == "attention" and row.record is not None
                    and row.status in ("equal", "permuted")), None)
    if pattern is None:
        return None
    paired = {row.reference: row.record for row in lined.rows if row.record is not None}
    extra = extra_params(module, records, paired, buffers=True)
    for record in records[pattern.index + 1:]:
        operands = [records[p] for p in _operands(record)]
        if record.func not in ADDS or len(operands) != 2:
            continue
        ups = [ancestors(o, records) | {o.index} for o in operands]
        if not all(pattern.index in up for up in ups):
            continue
        before = ancestors(pattern, records) | {pattern.index}  # the scores' own term is read there, not here
        ups = [up - before for up in ups]
        own = [o for o, up in zip(operands, ups, strict=True) if own_source(up, records, extra)]
        if len(own) != 1:
            continue
        made, said = record.details.get("op", record.label), source_words(own[0], records, extra, before)
        return (f"your code adds a term the reference has none of to the attention's output (line {record.line}: "
                f"{made}; {own[0].label} from your attention weights and {said}, as "
                "Shaw et al.'s relative values are): every step before it lines up, and the reference has no option "
                "for that term, so the steps from there on are not compared")
    return None


def unplaced(record: Record, records: list[Record], placed: bool = False) -> str:
    """The one line for a term trace finds but cannot place (or, `placed`, placed without the line-up fitting any
    better): no reference for it, no blame on the scale."""
    made = record.details.get("op", record.label)
    why = ("" if placed else "; trace adds such a term where it meets q · kᵀ as it is, or times one number (the "
           "scale), and here q · kᵀ is changed otherwise before the term meets it")
    return (f"your scores add a term trace has no reference for (line {record.line}: {made}, computed from your "
            "queries or keys and a table or the positions of your own, as a relative-position term is): the steps "
            f"from there on are not compared{why}")
