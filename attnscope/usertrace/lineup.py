"""Run the reference on the user's inputs (and weights), find each of its steps among the user's tensors,
and explain the first step that has no equal (line_up): under the conventions the code shows (conventionread.py),
then with what the module adds that the reference lacks (a scale per head, a bias or a term on its scores, a term,
a gate or ops on its output), each kept where it lines up further or names the mistake (ranking.py).

What a line-up is: lined.py; the line-up under one spec: underspec.py (the reference's run: refruns.py; its steps
lined up: alignsteps.py; the first divergence: firststep.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from attnscope.usertrace.conventionread import read_line_up
from attnscope.usertrace.ranking import better_fit, explained, sized_over_solved, steps_reached

if TYPE_CHECKING:
    from attnscope.usertrace.inputs import Inputs, ShapePlan
    from attnscope.usertrace.lined import LineUp
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Spec

SCORED = ("scores", "capped_scores", "biased_scores", "masked_scores", "attention")


def line_up(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
            spec: Spec | None = None, read_conventions: bool = True) -> LineUp:
    """The line-up under `spec`; where it diverges, under each convention the code's own tensors suggest
    (conventions.py) the first under which every step lines up, with a note saying the convention; and where the
    module adds a position bias of its own (ownbias.py, T5's), under the reference adding it too, where that lines
    up further or names the mistake."""
    from attnscope.usertrace.ownterm import output_term

    lined = _own_additions(module, shapes, inputs, records, train, spec, read_conventions)
    if read_conventions and spec is not None and spec.out_term is None and lined.divergence is not None:
        folded = _with_output_term(module, shapes, inputs, records, train, spec, lined)
        if folded is not None:
            return folded
    if read_conventions and spec is not None and spec.out_gate is None and lined.divergence is not None:
        gated = _with_output_gate(module, shapes, inputs, records, train, spec, lined)
        if gated is not None:
            return gated
    if read_conventions and spec is not None and spec.out_ops is None and lined.divergence is not None:
        opened = _with_output_ops(module, shapes, inputs, records, train, spec, lined)
        if opened is not None:
            return opened
    said = output_term(module, records, lined) if read_conventions else None
    if said is not None and lined.divergence is not None:  # Shaw's relative values: said, never blamed elsewhere
        lined.divergence.diagnosis, lined.divergence.evidence = said, None
    return lined


def _with_output_term(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
                      spec: Spec, lined: LineUp) -> LineUp | None:
    """The line-up with the reference adding the code's own term on its attention's output (outterm.py: Shaw's
    relative values), with a note, where that fits better than `lined`: clean, further, or a mistake upstream
    named by experiment (its rerun adds the term too); None otherwise."""
    from attnscope.usertrace import outterm

    term = outterm.found(module, records, lined)
    if term is None or spec.layout == "col":
        return None
    termed = replace(spec, out_term=term.tensor, out_queries=term.queries)
    again = _own_additions(module, shapes, inputs, records, train, termed, True)
    # the term's add, then ops of the code's own on the merge before its output projection (the Set Transformer's
    # `ln0` after `Q_ + A·V_`): compared up to the merge, the add the reference holds read as no op of the code's;
    # a mistake upstream is named only so, its rerun adding the term and compared where the ops begin
    opened = _with_output_ops(module, shapes, inputs, records, train, termed, again, frozenset({term.index})) \
        if again.no_reference is None else None
    again = opened if opened is not None else again
    # a mistake named by experiment at a step before the term's add or after it (the merge of the heads, OpenNMT's
    # unshape), where without the term the line-up diverged unnamed at what the code returns
    upstream = again.divergence is not None and lined.divergence is not None \
        and explained(again.divergence.experiment) == 2 and lined.divergence.experiment is None
    if again.no_reference is not None or not (better_fit(again, lined) or upstream):
        return None
    again.notes.insert(0, term.note)
    return again


def _with_output_gate(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
                      spec: Spec, lined: LineUp) -> LineUp | None:
    """The line-up with the reference multiplying its merged heads by the code's own output gate (outgate.py:
    OpenFold's sigmoid(linear_g(q_x))), with a note, where that fits better than `lined`: clean, further, or a mistake
    upstream named by experiment (its rerun gates too); None otherwise."""
    from attnscope.usertrace import outgate

    gate = outgate.found(records, lined) if module is not None and spec.layout != "col" else None
    if gate is not None and gate.mixes_tokens:  # another token's factor (gatetokens.py): said, not read
        lined.notes.append(gate.note)
        return None
    if gate is None and module is not None and spec.layout != "col":  # ops on each head's output (outops.py)
        from attnscope.usertrace.outops import head_factor

        gate = head_factor(module, records, lined)
    if gate is None:
        return None
    again = _own_additions(module, shapes, inputs, records, train,
                           replace(spec, out_gate=gate.tensor, gate_before_merge=gate.before_merge), True)
    if again.no_reference is not None or not better_fit(again, lined):
        return None
    again.notes.insert(0, gate.note)
    return again


def _with_output_ops(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
                     spec: Spec, lined: LineUp, held: frozenset[int] = frozenset()) -> LineUp | None:
    """The line-up compared up to the merge of the heads where the code applies ops of its own to its merged heads
    before its output projection (outops.py: BitNet's sub-norm, LeViT's activation), with a note, where that fits
    better than `lined`; None otherwise. `held`: the code's ops before the merge the reference already computes (the
    add of the code's own term on its output, outterm.py)."""
    from attnscope.usertrace import outops

    if lined.divergence is None or lined.divergence.experiment is not None:
        return None  # a mistake named by experiment (a dropout left on before the projection) stays named
    o = lined.trace is not None and module is not None and spec.layout != "col" and _output_widths(lined)
    note = outops.found(module, records, o, held) if o else None
    if note is None:
        return None
    again = _own_additions(module, shapes, inputs, records, train, replace(spec, out_ops=note), True)
    # as for an output term: a mistake named upstream (LeViT's own bias added after the softmax, read only with its
    # activation after the merge) where without the ops the line-up diverged unnamed
    upstream = again.divergence is not None and explained(again.divergence.experiment) == 2
    if again.no_reference is not None or not (better_fit(again, lined) or upstream):
        return None
    again.notes.insert(0, note)
    return again


def _output_widths(lined: LineUp) -> tuple[int, int] | None:
    """The reference's output projection's (in, out) widths, from its merge and its x."""
    trace = lined.trace
    if trace is None or "x" not in trace or "x_rsh2" not in trace:
        return None
    return int(trace["x_rsh2"].shape[-1]), int(trace["x"].shape[-1])


def _own_additions(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
                   spec: Spec | None, read_conventions: bool) -> LineUp:
    """line_up before the code's additions to its output are read: the module's own scale per head, and its bias
    or term on its scores."""
    first = read_line_up(module, shapes, inputs, records, train, spec, read_conventions)
    if not read_conventions or first.divergence is None or spec is None or spec.layout == "col":
        return first
    if spec.q_gain is None and module is not None:
        gained = _with_query_gain(module, shapes, inputs, records, train, spec, first)
        if gained is not None:
            return gained
    if spec.head_mix is None:
        mixed = _with_head_mix(module, shapes, inputs, records, train, spec, first)
        if mixed is not None:
            return mixed
    scaled = _with_head_scale(module, shapes, inputs, records, train, spec, first)
    return scaled if scaled is not None else _own_bias_or_term(module, shapes, inputs, records, train, spec, first)


def _with_query_gain(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool, spec: Spec,
                     first: LineUp) -> LineUp | None:
    """The line-up with the code's own gain per coordinate on its queries (querygain.py: TimesFM's per-dimension
    scale) held by the reference's query projection, the scale beside it 1 (the gain is the whole scale) or the
    reference's own, whichever fits better than `first`, with a note; None where the code has no such gain or
    neither fits better."""
    from attnscope.usertrace import querygain

    found = querygain.find(records, dict(module.named_parameters()))
    if found is None:
        return None
    for scale in ((1.0, None) if spec.scale is None else (spec.scale,)):
        said = "1 (the gain on your queries is then your module's whole scale, TimesFM's)" \
            if spec.scale is None and scale == 1.0 else spec.scale_from
        again = _own_additions(module, shapes, inputs, records, train,
                               replace(spec, q_gain=found, scale=scale, scale_from=said), True)
        if again.no_reference is None and (again.divergence is None or _kept(again, first)):
            again.notes.insert(0, querygain.note(found, scale != 1.0))
            return again
    return None


def _with_head_mix(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool, spec: Spec,
                   first: LineUp) -> LineUp | None:
    """The line-up with the reference mixing its heads' scores and weights as the code does (headmix.py: talking
    heads), with a note, where that fits better than `first`; where it does not, `first` with its divergence after
    the mixing said so (never a mask or a scale misread); None where the code mixes no heads."""
    from attnscope.usertrace import headmix

    found = headmix.found(records, first)
    if found is None:
        return None
    again = read_line_up(module, shapes, inputs, records, train, replace(spec, head_mix=found.matrices), True)
    if again.divergence is not None and again.divergence.experiment is None:
        again = _own_bias_or_term(module, shapes, inputs, records, train, replace(spec, head_mix=found.matrices),
                                  again)
    if _kept(again, first) or (again.no_reference is None and again.divergence is None):
        again.notes.insert(0, found.note())
        return again
    div = first.divergence
    assert div is not None
    if div.experiment is None and div.reference in (headmix.AFTER_PRE if found.pre else headmix.AFTER_PRE[3:]):
        names = [row.reference for row in first.rows]
        before = first.rows[:names.index(div.reference)] if div.reference in names else []
        equal = [row.reference for row in before if row.status in ("equal", "permuted")]
        div.diagnosis, div.evidence = found.words(equal[-1] if equal else None), None
    return first


def _with_head_scale(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool, spec: Spec,
                     first: LineUp) -> LineUp | None:
    """The line-up with the code's own scale per head (headscale.py: a learned temperature), and its bias or term on
    top of it (Swin V2's position bias after its cosine scores' temperature), with a note, where that fits better
    than `first`: further, or a mistake named there; None otherwise."""
    from attnscope.usertrace import headscale

    found = headscale.found(module, records, inputs, first)
    if found is None:
        return None
    said = first.divergence.experiment if first.divergence is not None else None
    if said is not None and said != "scale.other" and found.same:
        return None  # one number in every head that a mistake of the catalog gives (a learned scale set to 1/√d_model)
    scaled = replace(spec, head_scale=found.factors)
    again = read_line_up(module, shapes, inputs, records, train, scaled, True)
    if again.divergence is not None:
        again = _own_bias_or_term(module, shapes, inputs, records, train, scaled, again)
    if not _kept(again, first):
        return None
    again.notes.insert(0, found.note)
    return again


def _own_bias_or_term(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
                      spec: Spec, first: LineUp) -> LineUp:
    """The line-up with the module's own bias (ownbias.py) or term (ownterm.py) on its scores, where that fits
    better than `first`."""
    from attnscope.usertrace.ownbias import own_bias

    if spec.position_bias is not None or spec.alibi:
        return first
    own = own_bias(module, records, inputs)
    if own is None:  # a bias added to the scores in pieces (NAT's per-neighbour rpb): scattered to its cells
        from attnscope.usertrace.piecebias import piece_bias

        own = piece_bias(module, records, inputs, first.trace)
    if own is None:
        return _with_term(module, shapes, inputs, records, train, spec, first)
    bias, said = own
    again = read_line_up(module, shapes, inputs, records, train, replace(spec, position_bias=bias), True)
    if not _kept(again, first):
        return first
    again.notes.insert(0, said)
    return again


def _kept(again: LineUp, first: LineUp) -> bool:
    """Whether the line-up with the module's own addition to its scores (a bias, a term) fits the code better than
    `first`: further, or where its rerun names the mistake."""
    assert first.divergence is not None
    named = again.divergence is not None and again.divergence.experiment is not None \
        and first.divergence.experiment is None  # the bias's own step (biased_scores) comes before the attention
    return again.no_reference is None and (steps_reached(again) > steps_reached(first) or better_fit(again, first)
                                           or named)


def _with_term(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool, spec: Spec,
               first: LineUp) -> LineUp:
    """The line-up with the reference adding the code's own term on its scores (ownterm.py: Shaw's q · rel_k,
    Transformer-XL's q · R, DeBERTa's c2p), where that fits better; where the code adds such a term that trace
    cannot place, `first` with its divergence said so, in one line, rather than blamed on the scale."""
    from attnscope.usertrace.ownterm import Term, added_term, unplaced

    found = added_term(module, records, first)
    if found is None or first.divergence is None:
        return first
    if not isinstance(found, Term):
        if first.divergence.experiment is None and first.divergence.reference in SCORED:
            first.divergence.diagnosis, first.divergence.evidence = unplaced(found, records), None
        return first
    with_term = replace(spec, own_term=found.tensor, term_before_scale=found.before_scale)
    if found.width is not None and spec.scale is None:  # the scores contract over the joined width
        with_term = replace(with_term, scale=found.width ** -0.5,
                            scale_from=f"1/√{found.width}: the width your scores contract over")
    again = read_line_up(module, shapes, inputs, records, train, with_term, True)
    spread = _spread_scale(module, shapes, inputs, records, train, with_term, again, found.products)
    if spread is not None:
        spread.notes.insert(0, found.note)
        return spread
    if not _kept(again, first):
        if first.divergence.experiment is None and first.divergence.reference in SCORED:
            first.divergence.diagnosis, first.divergence.evidence = unplaced(found.record, records, True), None
        return first
    again.notes.insert(0, found.note)
    return again


def _spread_scale(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool, spec: Spec,
                  again: LineUp, products: int) -> LineUp | None:
    """DeBERTa's scale: 1/√((1 + m) · d_head) where the code adds m ≥ 2 products of its queries or keys with a table
    (c2p and p2c: its scale_factor, 1 + len(pos_att_type)), read as the module's own where the line-up under it is
    clean or goes further, with a note; None otherwise."""
    from attnscope.usertrace.ownterm import d_head_of

    d_head = d_head_of(again.trace) if again.trace is not None else None
    if products < 2 or spec.scale is not None or again.divergence is None or d_head is None:
        return None
    factor = 1 + products
    scale = (factor * d_head) ** -0.5
    spread = replace(spec, scale=scale, scale_from=f"1/√({factor}·d_head) = {scale:.6g} (DeBERTa's scale_factor)")
    lined = read_line_up(module, shapes, inputs, records, train, spread, True)
    if lined.no_reference is not None or not (better_fit(lined, again) or sized_over_solved(lined, again)):
        return None  # neither clean nor further, nor a mistake elsewhere named only under it (values from the keys)
    lined.notes.insert(0, f"scale 1/√({factor}·d_head) = {(factor * d_head) ** -0.5:.6g}: your scores sum q · kᵀ and "
                       f"{products} relative terms, each divided by √({factor}·d_head) (DeBERTa's scale_factor, 1 + "
                       "the number of relative terms); the reference scales so too, a convention (--scale gives "
                       "another)")
    return lined
