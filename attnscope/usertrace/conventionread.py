"""The line-up under the conventions the user's code shows (read_line_up): the module's own RoPE base, the softcap,
scale and clip its config says, a causal mask aligned lower-right where queries and keys differ in length, each
reading of conventions.py (RoPE's pairing, base, fraction, positions), ALiBi added before the scale (alibiorder.py:
Falcon's order), and a cache of keys before RoPE. A reading is kept where it lines up further, or where a rerun then
names the mistake at the same step (ranking.py), and is said in a note.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from attnscope.usertrace.ranking import better_fit, explained, sees, steps_reached
from attnscope.usertrace.underspec import line_up_under

if TYPE_CHECKING:
    from attnscope.usertrace.inputs import Inputs, ShapePlan
    from attnscope.usertrace.lined import LineUp
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Spec


def read_line_up(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
                 spec: Spec | None = None, read_conventions: bool = True) -> LineUp:
    """The line-up under `spec` and the conventions the code shows (module doc), before what the module adds that
    the reference lacks (lineup.py reads that: its own bias, a scale per head, ...)."""
    from attnscope.usertrace import clips, conventions
    from attnscope.usertrace.declared import own_scaling

    said_base = None
    declared = conventions.own_base(module, spec.built_with) if spec is not None and spec.rope_base is not None \
        else None
    default = spec is not None and spec.rope_base == conventions.DEFAULT_BASE and not spec.base_asked
    if spec is not None and declared is not None and default and declared != spec.rope_base \
            and not takes_tables(module):
        # the module's own rope_theta, where --rope-base said none
        from attnscope.usertrace.declared import base_where

        spec = replace(spec, rope_base=declared, base_from_module=True,
                       base_where=base_where(module, spec.built_with) or "")
    if spec is not None and spec.base_from_module and spec.rope_base is not None:  # read here or by the caller
        declared = spec.rope_base
        said_where = spec.base_where or "its rope_theta or base, or its config's"
        said_base = f"RoPE base {declared:g}, read from your module ({said_where}); --rope-base overrides it"
        if module is not None:  # its config's base against the module's own attribute: the config's is the reference's
            from attnscope.usertrace.declared import base_disagreement

            said_base = base_disagreement(module, spec.built_with) or said_base
    own_notes: list[str] = []
    if spec is not None and module is not None:  # the softcap and scale the module's config says
        from attnscope.usertrace.declared import DECLARED_CLIP, with_declared

        spec, own_notes = with_declared(module, spec)
        clipped = clips.read(records) if spec.clip_qkv is None else None
        if clipped is not None:  # a clamp of the projections' output no config says (DBRX's qkv.clamp)
            spec = replace(spec, clip_qkv=clipped[0])
            own_notes.append(clips.note(*clipped))
        spec, where = clips.placed(records, spec)  # after the qk-norm (HF OLMoE's clamp), not the projection
        if where:  # said in place of the config's note, which puts the clip after the projection
            own_notes = [n for n in own_notes if not n.startswith(DECLARED_CLIP)] + [where]
    first = line_up_under(module, shapes, inputs, records, train, spec)
    if said_base is not None:
        first.notes.insert(0, said_base)
    first.notes[:0] = own_notes
    if not read_conventions or first.divergence is None or first.trace is None or spec is None:
        return first
    if spec.causal == "upper-left" and not spec.align_asked and not spec.cache \
            and inputs.sizes.get("n_Q") != inputs.sizes.get("n_K"):
        # keys and queries of different lengths: a causal mask aligned to the last key is another convention
        lower = line_up_under(module, shapes, inputs, records, train, replace(spec, causal="lower-right"))
        if lower.no_reference is None and better_fit(lower, first):
            row = next((r for r in lower.rows if r.reference == "masked_scores" and r.record is not None), None)
            where = f" (line {row.record.line})" if row is not None and row.record is not None else ""
            lower.notes.insert(0, f"causal mask as your code computes it{where}: aligned lower-right, query i sees "
                                  "keys 0 to n_K − n_Q + i, so the last query sees every key (flash-attn's and "
                                  "x-transformers' alignment, F.scaled_dot_product_attention's is_causal being "
                                  "upper-left). " + ("A convention, not a mistake: the reference was masked so; "
                                                     if lower.divergence is None else
                                                     "Read from your code, and the reference masked so: the "
                                                     "divergence below is another matter; ")
                                  + "--causal lower-right says it")
            if said_base is not None:
                lower.notes.insert(0, said_base)
            lower.notes[:0] = own_notes
            return lower
    if spec.causal == "upper-left" and spec.align_asked and not spec.cache \
            and inputs.sizes.get("n_Q") != inputs.sizes.get("n_K"):
        # --causal upper-left typed: the code's lower-right alignment is then a bug, said as what the code does
        lower = line_up_under(module, shapes, inputs, records, train, replace(spec, causal="lower-right"))
        if lower.no_reference is None and better_fit(lower, first):
            first.notes.insert(0, "your code's causal mask is aligned lower-right (query i sees keys 0 to n_K − n_Q + "
                                  "i: the reference run so lines up further) where --causal upper-left asks query i "
                                  "to see keys 0 to i; as asked, that is the divergence below (--causal lower-right "
                                  "if the alignment is meant)")
    first, spec, strided = _strided_read(module, shapes, inputs, records, train, spec, first)
    if strided is not None and (first.divergence is None or first.trace is None):
        first.notes[:0] = [strided, *([said_base] if said_base is not None else []), *own_notes]
        return first
    best, best_said, reached = first, None, steps_reached(first)
    base_free = default and declared is None
    scaled = own_scaling(module, spec.built_with)
    assert first.trace is not None  # a line-up that diverged was run
    for other, said in conventions.readings(spec, first.trace, first.rows, records, base_free, scaled):
        again = line_up_under(module, shapes, inputs, records, train, other)
        if again.divergence is not None and spec.cache:  # RoPE read so, and a cache of keys before RoPE
            again = _cache_read(module, shapes, inputs, records, train, again)
        if _undoes(again, other, spec):
            continue  # read as the code's convention, then called a mistake by the rerun that undoes it: no reading
        if again.no_reference is None and (steps_reached(again) > reached and sees(again, best)
                                            or steps_reached(again) == reached and better_fit(again, best)):
            # the code's tensors say it, further on, or where a rerun then names the mistake at the same step
            best, best_said, reached = again, said, steps_reached(again)
            if again.divergence is None:
                break
    if best.divergence is not None:  # ALiBi added before the scale (alibiorder.py: Falcon's order)
        best = _alibi_read(module, shapes, inputs, records, train, best)
    if best.divergence is not None and spec.cache:
        best = _cache_read(module, shapes, inputs, records, train, best)
    fresh = best is not first or strided is not None  # a line-up other than the first one, whose notes it lacks
    if said_base is not None and fresh:
        best.notes.insert(0, said_base)
    if fresh:
        best.notes[:0] = own_notes
    if best_said is not None:  # a convention read from the code: said, whether or not a later step diverges
        line = next((row.record.line for row in best.rows
                     if row.reference in ("Q_rot", "K_rot") and row.record is not None), None)
        best.notes.insert(0, conventions.note(best_said, line, clean=best.divergence is None))
    if strided is not None:
        best.notes.insert(0, strided)
    return best


def _strided_read(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool, spec: Spec,
                  first: LineUp) -> tuple[LineUp, Spec, str | None]:
    """The line-up with the heads split strided (stridedheads.py: each head every n_head-th feature, the queries',
    keys' and values' alike), where that lines up every split and goes further: it, its spec and its note; `first`,
    `spec` and None otherwise."""
    from attnscope.usertrace import stridedheads

    other = stridedheads.reading(spec, first, records, inputs.sizes)
    if other is None:
        return first, spec, None
    again = line_up_under(module, shapes, inputs, records, train, other)
    if not stridedheads.kept(again) or not (steps_reached(again) > steps_reached(first) or better_fit(again, first)):
        return first, spec, None
    line = next((row.record.line for row in again.rows if row.reference == "Q_split" and row.record is not None), None)
    return again, other, stridedheads.note(line, again.divergence is None)


def _cache_read(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
                best: LineUp) -> LineUp:
    """The line-up with the code's cache read as keys before RoPE (cachekeys.py: the code rotates the joined keys
    at their positions), where that lines up further or names the mistake; `best` otherwise."""
    from attnscope.usertrace import cachekeys

    spec = best.spec
    held = cachekeys.unrotated(inputs, spec) if spec is not None else None
    if held is None or spec is None:
        return best
    again = line_up_under(module, shapes, held, records, train, replace(spec, cache_before_rope=True))
    if again.no_reference is not None or not (steps_reached(again) > steps_reached(best) or better_fit(again, best)):
        return best
    line = next((row.record.line for row in again.rows if row.reference == "K_cat" and row.record is not None), None)
    again.notes.insert(0, cachekeys.note(line, again.divergence is None))
    return again


def _alibi_read(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], train: bool,
                best: LineUp) -> LineUp:
    """The line-up with ALiBi's slopes times the scale (alibiorder.py: the code adds the bias before it scales),
    with a note, where that lines up further or names the mistake without undoing itself; `best` otherwise."""
    from attnscope.usertrace import alibiorder

    spec = best.spec
    other = alibiorder.reading(spec, best) if spec is not None else None
    if other is None or spec is None:
        return best
    again = line_up_under(module, shapes, inputs, records, train, other)
    if again.no_reference is not None or _undoes(again, other, spec):
        return best
    assert best.divergence is not None
    reached, before = steps_reached(best), best.divergence.experiment
    # a mistake named by experiment under the reading (its rerun with these slopes gives the code's tensors back:
    # the scale applied twice as well, ALiBi's sign flipped) where the first line-up named none, or could only fit
    # other slopes (ALiBi's times minus the scale, for the sign) where the reading diverges no sooner
    named = again.divergence is not None and explained(again.divergence.experiment) == 2 \
        and (before is None or before == "alibi.slopes" and steps_reached(again) >= reached)
    if not (steps_reached(again) > reached and sees(again, best)
            or steps_reached(again) == reached and better_fit(again, best) or named):
        return best
    again.notes.insert(0, alibiorder.note(again, again.divergence is None))
    return again


def _undoes(lined: LineUp, reading: Spec, spec: Spec) -> bool:
    """Whether the divergence under a reading is named by the experiment that changes back what the reading changed
    (the pairing read as interleaved, then `rope.pairing` by experiment): the reading contradicts itself."""
    experiment = lined.divergence.experiment if lined.divergence is not None else None
    changed = {"rope.pairing": reading.rope_pairing != spec.rope_pairing and not reading.rope_tables,
               "rope.base": reading.rope_base != spec.rope_base,
               "rope.fraction": reading.rope_fraction != spec.rope_fraction,
               "rope.positions": reading.rope_start != spec.rope_start,
               "alibi.slopes": reading.alibi_slopes != spec.alibi_slopes}
    return bool(experiment is not None and changed.get(experiment))


def takes_tables(module: Any) -> bool:
    """Whether the module's forward takes RoPE's tables (trace makes them with the reference's base)."""
    import inspect

    from attnscope.usertrace.load import table_kind

    try:
        return any(table_kind(name) is not None for name in inspect.signature(module.forward).parameters)
    except (TypeError, ValueError, AttributeError):
        return False
