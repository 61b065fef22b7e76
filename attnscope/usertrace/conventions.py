"""Conventions read from the code: where the line-up diverges, the ways correct code may differ from the reference
(RoPE's pairing where --rope-pairing did not say it, the share of each head it turns, the position of the first
token) are read off the user's own rotated tensor, and the reference is run again under each reading. A reading
under which every step finds its equal is the code's convention: a note says it, and the run is clean. A reading
that leaves a step without its equal is no convention, and the first line-up's divergence stands (a bug is never
explained away: the rerun must reproduce every tensor).

What is read, from the user's Q_rot (K_rot) against the reference's unrotated Q_split (K_split), in float64:
- the rotated share of each head: the coordinates the code changed (GPT-NeoX's `rotary_pct`, transformers'
  `partial_rotary_factor`: the first `int(fraction · d_head)` turn, the rest pass through);
- the pairing, half-split (transformers' `rotate_half`) or interleaved (Meta's `view_as_complex`, GPT-J's
  `rotate_every_two`): both are tried;
- the first position: the angle the slowest pair turned at the first query, over its frequency (code that counts
  from 1; scores depend on i − j alone, so the attention is the same);
- the direction: the fastest pair turns one radian a position, +1 (transformers' `x·cos + rotate_half(x)·sin`) or
  -1 (nanochat's `x1·cos + x2·sin, −x1·sin + x2·cos`, Meta's table conjugated): q·k then depends on j − i, a
  relative position all the same. Code that turns q one way and k the other lines up under neither.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace import owntables

# what the module declares (its rope_theta, rotary_pct, ...), read in one place with its softcap and scale
from attnscope.usertrace.declared import own_base as own_base
from attnscope.usertrace.declared import own_fraction as own_fraction
from attnscope.usertrace.ropefreqs import pair_turns

if TYPE_CHECKING:
    from attnscope.trace import Trace
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Spec

PAIRING_WORDS = {"interleaved": "interleaved, (2i, 2i + 1) (Meta's view_as_complex, GPT-J's rotate_every_two)",
                 "half-split": "half-split, (i, i + d_head/2) (transformers' rotate_half)"}


DEFAULT_BASE = 10000.0  # the reference's base where neither --rope-base nor the module says one (runs/options.py's)
def readings(spec: Spec, trace: Trace, rows: list[Any], records: list[Record],
             base_free: bool = False, scaled: Any = None) -> list[tuple[Spec, list[str]]]:
    """Other specs the code's tensors suggest, each with what it says of the code, the likeliest first; empty
    where no convention is in question (no RoPE, or its rotated tensors line up). `rows` are the line-up's
    (lined.Aligned). `base_free`: neither --rope-base nor the module says the base, so the base the code rotates
    with is read too (its own choice). `scaled`: the RoPE scaling the module declares (declared.own_scaling, a
    Rope), whose frequencies the code's must then be."""
    if spec.rope_base is None:  # a 2-D RoPE no flag describes is read all the same (a 1-D one is rope.untold)
        return _angles(spec, trace, records)
    by_step = {row.reference: row for row in rows}
    user = _rotated(by_step, trace, records)
    if user is None:
        return []
    source, mine, row = user
    d = source.shape[-1]
    rotated = _rotated_share(source, mine, trace[row.reference])
    fractions = [spec.rope_fraction]
    # the config's fraction is the module's own: code that rotates another share has a bug, not a convention
    if rotated is not None and 0 < rotated < d and rotated % 2 == 0 and not spec.fraction_from_module:
        fractions.insert(0, rotated / d)
    pairings = [spec.rope_pairing] if spec.pairing_asked else [
        spec.rope_pairing, "interleaved" if spec.rope_pairing == "half-split" else "half-split"]
    found: list[tuple[Spec, list[str]]] = []
    seen = {(spec.rope_pairing, spec.rope_fraction, spec.rope_start, spec.rope_base, spec.rope_sign)}
    bases = [spec.rope_base]
    if base_free:
        from attnscope.usertrace.rotary import fit_base

        n = source.shape[-2]
        start0 = spec.cache if spec.cache else 0
        for pairing in pairings:
            fitted_base = fit_base(source.double(), mine.double(), torch.arange(start0, start0 + n),
                                    "interleaved" if pairing == "interleaved" else "half")
            if fitted_base is not None and not any(math.isclose(fitted_base, b, rel_tol=1e-3) for b in bases):
                bases.insert(0, fitted_base)
    for pairing, fraction, base in ((p, f, b) for p in pairings for f in fractions for b in bases):
        width = int(d * fraction) if fraction else d
        # the way each pair turns, +θ or −θ, read off its fastest pair (a turn of one radian a position)
        read = _direction(source, mine, pairing, width, (spec.cache or 0) + spec.rope_start, spec.rope_sign)
        # the turn read, then the reference's own: heads split the wrong way make the code's rotated tensor no
        # turn of the reference's heads, and what is read off it then says nothing of the direction
        signs = [read] + ([spec.rope_sign] if read != spec.rope_sign else [])
        starts = [spec.rope_start]
        # in a decode step the cached keys hold their positions: a shift of the new ones is no convention
        fitted = _first_position(source, mine, replace(spec, rope_base=base), pairing, width, read) \
            if not spec.cache else None
        if fitted is not None and fitted not in starts:
            starts.insert(0, fitted)
        for sign, start in ((s, t) for s in signs for t in starts):
            if (pairing, fraction, start, base, sign) in seen:
                continue
            seen.add((pairing, fraction, start, base, sign))
            said = []
            if sign != spec.rope_sign:
                said.append("it turns each pair by −θ where the reference turns it by +θ (x1·cos + x2·sin, "
                            "−x1·sin + x2·cos: nanochat's apply_rotary_emb, the sin table's sign flipped); q·k "
                            "then depends on j − i instead of i − j, a relative position all the same"
                            if sign == -1 else "it turns each pair by +θ")
            if base != spec.rope_base:
                said.append(f"it rotates with RoPE base {base:g} (read from the angles your code turns each pair by; "
                            "neither --rope-base nor your module names another)")
            if pairing != spec.rope_pairing:
                said.append(f"your code pairs RoPE's coordinates {PAIRING_WORDS[pairing]}")
            if fraction != spec.rope_fraction:
                said.append(f"it rotates the first {width} of each head's {d} coordinates (a rotary "
                            f"fraction of {fraction:g}, GPT-NeoX's rotary_pct, transformers' "
                            "partial_rotary_factor) and passes the rest through")
            if start != spec.rope_start:
                said.append(f"it counts positions from {start} (the scores depend on i − j alone, so the "
                            "attention is the same)")
            found.append((replace(spec, rope_pairing=pairing, rope_fraction=fraction, rope_start=start,
                                  rope_base=base, rope_sign=sign), said))
    if not spec.fraction_from_module:  # the base's frequencies scaled (linear, or as the module declares)
        found += _scaled(spec, source, mine, pairings, scaled)
    if base_free and not spec.fraction_from_module:  # a frequency table of the code's own, tried last
        for source, mine, _ in _rotated(by_step, trace, records, every=True):
            tables = _tables(spec, source, mine, pairings, fractions)
            if tables:
                found += tables
                break
    return found + _angles(spec, trace, records)


def _angles(spec: Spec, trace: Trace, records: list[Record]) -> list[tuple[Spec, list[str]]]:
    """The reading with each token's angles read whole from the code's rotated queries and keys (ropefreqs.Angles:
    2-D or axial RoPE, a prefix kept unrotated), where no one 1-D position gives them; self-attention without a
    cache alone (the table is read for the tokens the code holds)."""
    from attnscope.usertrace import ropefreqs

    if spec.cache or spec.layout != "row":
        return []
    # the heads before RoPE: a norm over the whole projection (OLMo 2's) comes before the split, and is no heads
    q, k = (next((trace[s] for s in names if s in trace and trace[s].shape == trace[names[1]].shape), None)
            for names in (("Q_normed", "Q_split"), ("K_normed", "K_split")))
    if q is None or k is None or q.dim() < 3:
        return []
    read = ropefreqs.angles_from(records, q, k, trace.get("V_split"))
    said, own = (read.words(), False) if read is not None else ("", True)
    if read is None:  # no rotation of the reference's heads: the angles of the code's own tables, where it has them
        tables = owntables.angles_from_tables(records, q.shape[-2], q.shape[-1])
        if tables is None:
            return []
        read, said = tables[0], owntables.words(tables[1])
    return [(replace(spec, rope_base=spec.rope_base or DEFAULT_BASE, rope_pairing=read.pairing, rope_fraction=None,
                     rope_start=0, rope_sign=1, rope_freqs=None, rope_angles=read.table, rope_tables=own), [said])]


def _tables(spec: Spec, source: torch.Tensor, mine: torch.Tensor, pairings: list[str],
            fractions: list[float | None]) -> list[tuple[Spec, list[str]]]:
    """Readings with each pair's frequency read from the rotated tensors (ropefreqs.py), where no base gives them:
    under each pairing and rotated share, the code's direction with them."""
    from attnscope.usertrace import ropefreqs

    d, first = source.shape[-1], (spec.cache or 0) + spec.rope_start
    found: list[tuple[Spec, list[str]]] = []
    # over the whole head only: a share of it turning at frequencies of another width is rope.fraction's mistake
    # (GPT-NeoX's inv_freq spread over the head while rotary_ndims turn), never a table of the code's own
    for pairing, fraction in ((p, f) for p in pairings for f in fractions if not f or f == 1):
        width = d
        table = ropefreqs.read(source.double(), mine.double(), pairing, width, first)
        if table is None or ropefreqs.is_base(table, float(spec.rope_base or DEFAULT_BASE), width):
            continue
        said = [table.words()]
        if table.sign != spec.rope_sign:
            said.append("each turns by −θ where the reference turns it by +θ (x1·cos + x2·sin, −x1·sin + x2·cos); "
                        "q·k then depends on j − i instead of i − j, a relative position all the same"
                        if table.sign == -1 else "each turns by +θ")
        if pairing != spec.rope_pairing:
            said.append(f"your code pairs RoPE's coordinates {PAIRING_WORDS[pairing]}")
        found.append((replace(spec, rope_pairing=pairing, rope_fraction=fraction, rope_sign=table.sign,
                              rope_freqs=table.freqs), said))
    return found


def _scaled(spec: Spec, source: torch.Tensor, mine: torch.Tensor, pairings: list[str],
            scaled: Any) -> list[tuple[Spec, list[str]]]:
    """Readings with each pair's frequency read from the rotated tensors (ropefreqs.py), over the whole head: the
    base's own over one factor (linear scaling, positions t / f: a convention, as the base is), or the frequencies
    the RoPE scaling the module declares gives the base (`scaled`: dynamic NTK, llama3, yarn move them; another
    base under it stays `rope.base`)."""
    from attnscope.errors import AttnscopeError
    from attnscope.usertrace import ropefreqs

    d, first, base = source.shape[-1], (spec.cache or 0) + spec.rope_start, float(spec.rope_base or DEFAULT_BASE)
    found: list[tuple[Spec, list[str]]] = []
    if spec.rope_fraction not in (None, 1):
        return found
    declared = None
    if scaled is not None:
        try:
            declared = replace(scaled, base=base).inv_freq(d, first + source.shape[-2]).double()
        except AttnscopeError:
            declared = None
    for pairing in pairings:
        table = ropefreqs.read(source.double(), mine.double(), pairing, d, first)
        # the base's own frequencies are read by base, unless a declared scaling scales cos and sin (yarn's factor)
        if table is None or ropefreqs.is_base(table, base, d) and (scaled is None or scaled.attention_scaling == 1):
            continue
        factor = ropefreqs.linear_factor(table, base, d)
        if factor is not None:
            said = [f"it turns each pair at base {base:g}'s frequency over {factor:g}, so positions are scaled by "
                    f"1/{factor:g} (linear RoPE scaling, position interpolation: transformers' rope_scaling = "
                    f"{{'type': 'linear', 'factor': {factor:g}}})"]
        elif declared is not None and len(declared) == len(table.freqs) and all(
                math.isclose(f, float(w), rel_tol=1e-3, abs_tol=1e-7) for f, w in zip(table.freqs, declared,
                                                                                     strict=True)):
            said = [f"it turns its pairs at the frequencies its rope_scaling ({scaled.kind}) gives base {base:g}, "
                    "read from your rotated tensors and checked against what your module declares"]
        else:
            continue
        if table.sign != spec.rope_sign:
            said.append("each turns by −θ where the reference turns it by +θ" if table.sign == -1 else
                        "each turns by +θ")
        if pairing != spec.rope_pairing:
            said.append(f"your code pairs RoPE's coordinates {PAIRING_WORDS[pairing]}")
        own = replace(scaled, base=base, pairing=pairing) if factor is None and table.sign == 1 else None
        found.append((replace(spec, rope_pairing=pairing, rope_sign=table.sign, rope_freqs=table.freqs,
                              rope_declared=own), said))
    if not found and declared is not None and spec.rope_sign == 1:
        # the scaling the module declares, where the code's rotation gives it in no pairing or at another base (a
        # pairing or a base slipped under it): the reference turns as declared, the slip a mistake the catalog
        # names under the same scaling
        found.append((replace(spec, rope_freqs=tuple(float(f) for f in declared),
                              rope_declared=replace(scaled, base=base, pairing=spec.rope_pairing)),
                      [f"your module declares rope_scaling ({scaled.kind}): the reference turns its pairs at the "
                       f"frequencies that gives base {base:g} (your rotated tensors turn otherwise)"]))
    return found


def note(said: list[str], line: int | None, clean: bool = True) -> str:
    """The note of a convention the rerun confirmed: every step lines up under it (`clean`), or the divergence
    is met further on than without it (then it is read from the code, and the divergence is another matter)."""
    where = f" (line {line})" if line else ""
    pairing = any("pairs RoPE's coordinates" in s for s in said)
    if not clean:
        source = "your code's tables" if any(s.startswith(owntables.SAID) for s in said) else "your rotated tensors"
        return (f"RoPE as your code computes it{where}: " + "; ".join(said) + f". Read from {source}, and "
                "the reference rotated so: the divergence below is another matter")
    return (f"RoPE as your code computes it{where}: " + "; ".join(said) + ". A convention, not a mistake: the "
            "reference was rotated so, and every step lines up" + (
                " (--rope-pairing asks for one pairing, and then checks it)" if pairing else ""))


def _rotated(by_step: dict[str, Any], trace: Trace, records: list[Record], every: bool = False) -> Any:
    """The reference's unrotated tensor, the user's rotated one in the reference's layout, and its row, for the
    first of Q_rot, K_rot that differs: the user's tensor the row holds, else the one the code hands the scores
    (its left or right operand, or the kernel's q or k), where it is not the unrotated one (also where no tensor
    of the code's lines up with the step: a decode step that rotates the joined keys makes no K_rot). `every`: all
    such tensors of that step, the one that keeps the head vectors' lengths first."""
    from attnscope.usertrace.align import Layout, layouts
    from attnscope.usertrace.flow import operands

    handed = operands(records)
    for side, (step, before) in enumerate((("Q_rot", ("Q_normed", "Q_split", "Q")),
                                           ("K_rot", ("K_normed", "K_split", "K")))):
        row = by_step.get(step)
        if step not in trace:  # latent attention's rotary parts (usertrace/latentref.py tries its forms itself)
            continue
        shape = tuple(trace[step].shape)
        # the unrotated step laid out as the rotated one (a qk-norm over the projection, OLMo 2's, is [.., d_feat])
        source = next((s for s in before if s in trace and tuple(trace[s].shape) == shape), None)
        if row is None or row.status not in ("differs", "missing", "unseen") or source is None:
            continue
        unrotated = trace[source].double()
        tried = [(row.record, Layout(row.order, row.merged, row.split))] if row.record is not None and row.order else []
        if handed is not None:
            operand = records[handed[0] if side == 0 else handed[1]]
            tried += [(operand, layout) for layout in layouts(shape, tuple(operand.tensor.shape))]
        differing = []
        for record, layout in tried:
            try:
                mine = layout.undo(record.tensor, shape).double()
            except RuntimeError:
                continue
            if not torch.allclose(mine, unrotated, atol=1e-6, rtol=1e-5):
                differing.append((unrotated, mine, replace(row, record=record)))
        # a rotation keeps each head vector's length: the tensor that does is the rotated one (the row may hold
        # a tensor from before a qk-norm, which differs from the unrotated step by more than a turn)
        kept = next((found for found in differing if torch.allclose(
            found[1].norm(dim=-1), unrotated.norm(dim=-1), rtol=1e-4, atol=1e-5)), None)
        if kept is not None or differing:
            return [kept, *differing] if every and kept is not None else differing if every else kept or differing[0]
    return None


def _rotated_share(source: torch.Tensor, mine: torch.Tensor, reference: torch.Tensor) -> int | None:
    """How many leading coordinates of each head the code changed (the rest equal the unrotated tensor), rounded
    up to a pair; None where the code changed none."""
    from attnscope.usertrace.align import tolerance

    changed = ((mine - source).abs() > tolerance(reference)).flatten(0, -2).any(0)  # [d_head]
    if not bool(changed.any()):
        return None
    last = int(torch.nonzero(changed).max()) + 1
    return last + last % 2


def _direction(source: torch.Tensor, mine: torch.Tensor, pairing: str, width: int, first: int, default: int) -> int:
    """+1 where the code turns each pair by +θ (transformers' x·cos + rotate_half(x)·sin), -1 by −θ (nanochat's
    x1·cos + x2·sin), read off the fastest pair, which turns one radian a position (any base): from one position
    to the next, +1 or -1 radian (whatever the first position, right or wrong); a single query against ±`first`.
    `default` where neither fits better (a single query at 0)."""
    if width < 2:
        return default
    turned = pair_turns(source.double(), mine.double(), pairing, width, 0)  # [n]
    if turned.shape[-1] > 1:
        turned, expected = turned[1:] - turned[:-1], torch.ones(turned.shape[-1] - 1, dtype=torch.float64)
    else:
        expected = torch.full_like(turned, float(first))

    def miss(sign: int) -> float:
        return float(torch.remainder(turned - sign * expected + math.pi, 2 * math.pi).sub(math.pi).abs().sum())

    plus, minus = miss(1), miss(-1)
    if abs(plus - minus) < 1e-3 * turned.shape[-1]:
        return default
    return 1 if plus < minus else -1


def _first_position(source: torch.Tensor, mine: torch.Tensor, spec: Spec, pairing: str, width: int,
                    sign: int = 1) -> int | None:
    """The position the code gave the first query (key), fitted from the angle its slowest rotated pair turned
    there over that pair's frequency (turned by `sign` · θ), minus where the reference puts it; None where that
    is no whole number."""
    if width < 2 or spec.rope_base is None:
        return None
    pair = width // 2 - 1
    turned = pair_turns(source, mine, pairing, width, pair)  # [n]: the angle at each position
    frequency = spec.rope_base ** (-2 * pair / width)
    fitted = sign * float(turned[0]) / frequency
    if not math.isfinite(fitted) or abs(fitted - round(fitted)) > 0.05:
        return None
    start = round(fitted)
    return start if abs(start) <= 4096 else None
