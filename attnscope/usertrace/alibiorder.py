"""ALiBi added before the scale (Falcon's `(q · kᵀ + alibi) · inv_norm_factor`), read from the code by experiment:
the scale multiplies the bias too, so the code adds ALiBi's slopes times the scale after scaling. That is a
convention, not a mistake: the reference is run again with its slopes `2^(-8 h / n_head)` times its scale (the
core spec's `alibi_slopes`), and where that rerun reproduces every tensor of the code's, a note says so.

No name is read: a module whose slopes are wrong (not the geometric sequence, or off by a factor other than the
scale: the scale applied twice) does not line up under the reading, whose rerun then names `alibi.slopes` (the
reading undoes itself) or goes no further, and the first line-up's divergence stands (conventionread.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnscope.usertrace.lined import LineUp
    from attnscope.usertrace.reference import Spec


def reading(spec: Spec, lined: LineUp) -> Spec | None:
    """The spec whose ALiBi slopes are ALiBi's times the scale, where the reference adds ALiBi with its own slopes
    and one scale for every head; None otherwise."""
    from attnscope.usertrace.ownterm import d_head_of
    from attnscope.variants import alibi

    trace = lined.trace
    if not spec.alibi or spec.alibi_slopes is not None or spec.head_scale is not None or trace is None \
            or "alibi_bias" not in trace:
        return None
    d_head = d_head_of(trace)
    if d_head is None:
        return None
    scale = spec.scale if spec.scale is not None else d_head ** -0.5
    n_head = int(trace["alibi_bias"].shape[-3]) if trace["alibi_bias"].dim() >= 3 else 1
    slopes = tuple(float(m) * scale for m in alibi.slopes(n_head).double().tolist())
    return replace(spec, alibi_slopes=slopes)


def note(lined: LineUp, clean: bool) -> str:
    """What the reading says of the code: where it adds the bias (the step the reference's biased scores line up
    with), and, where every step lines up, whether its scaled, unbiased scores exist (then it adds slopes already
    times the scale after scaling: the same numbers)."""
    from attnscope.usertrace.lined import ALIGNED

    rows = {row.reference: row for row in lined.rows}
    biased = rows.get("biased_scores")
    line = biased.record.line if biased is not None and biased.record is not None else None
    scores = rows.get("scores")
    slopes = ", ".join(f"{m:.4g}" for m in (lined.spec.alibi_slopes or ())[:4]) if lined.spec is not None else ""
    more = ", ..." if lined.spec is not None and len(lined.spec.alibi_slopes or ()) > 4 else ""
    scale = lined.spec.scale if lined.spec is not None else None  # --scale, or the module's own: the reference's
    named = "the 1/√d scale" if scale is None else f"the scale {scale:.4g}"
    if clean and scores is not None and scores.status in ALIGNED:  # scaled first, then a bias times the scale
        said = (f"ALiBi's slopes times {named}, added after it ({f'line {line}, ' if line else ''}slopes "
                f"{slopes}{more}): the same numbers as ALiBi added before the scale (Falcon's order)")
    else:
        at = f", line {line}" if line else ""
        times = "slopes/√d" if scale is None else f"slopes × {scale:.4g}"
        said = (f"ALiBi added before {named} (Falcon's order{at}): the same as {times} after it (slopes "
                f"{slopes}{more}, ALiBi's times the scale)")
    if not clean:
        return said + "; read from your scores, and the reference biased so: the divergence below is another matter"
    return said + "; a convention, not a mistake: the reference was biased so, and every step lines up"
