"""The catalog's qk-norm mistakes, where the reference normalizes q and k (`--qk-norm`, or the code's own norms read as
its convention): a side left unnormalized, the values normalized too, and, where `--qk-norm` told the reference
its norm (read from the code, they are its convention), the norm on the other side of RoPE or over the other axis
(each head's d_head, or the whole projection).

Each rerun starts from the reference's own q and k before its norm and RoPE and its norm refit from its own steps
(fusedsplit.refit_parts: RMSNorm or LayerNorm, a gain and bias per head and coordinate), so the norm's weights are
the reference's whatever the code calls them; the mistake is applied, the heads rotated as the reference rotates
them, and the attention replayed from there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from attnscope.usertrace.fusedsplit import Norm, merged, normed, refit_over_projection, refit_parts
from attnscope.usertrace.rerun import Base, replay
from attnscope.usertrace.roperead import ReadRope, read_rope, rope_turn
from attnscope.usertrace.trials import Trial

ROLES = {"Q": "queries", "K": "keys"}


@dataclass
class _Side:
    """One of q and k as the reference norms it: its heads before the norm and RoPE `[.., heads, n, d]`, where the
    norm runs ("proj": over the whole projection before the split; "head": each head before RoPE; "late": each
    rotated head), the norm's parts (the gain and bias `[1, heads, 1, d]`), its positions and the axis it runs over."""

    name: str
    raw: torch.Tensor
    place: str
    unit: Norm
    gain: torch.Tensor
    bias: torch.Tensor
    positions: torch.Tensor | None
    over: str = "head"  # the axis the norm runs over: each head's d_head, or the whole projection ("proj")

    def normed(self, x: torch.Tensor, over: str) -> torch.Tensor:
        """x `[.., heads, n, d]` normalized over each head ("head") or over every head's coordinates at once
        ("proj"), the reference's gain and bias per head and coordinate."""
        return normed(self.unit, self.gain, self.bias, x, over)


def _side(b: Base, name: str) -> _Side | None:
    from attnscope.usertrace.reference import late_norm

    normed, split, feat = (b.ref.get(f"{name}_{s}") for s in ("normed", "split", "feat"))
    over = "head"
    if normed is None or split is None or split.dim() != 4 or b.names.get(name.lower()) not in (
            f"{name}_rot", f"{name}_normed", f"{name}_split"):
        return None
    heads, d = int(split.shape[-3]), int(split.shape[-1])
    rope = read_rope(b)
    positions = None if rope is None else (rope.q_pos if name == "Q" else rope.k_pos)
    if normed.dim() == 3 and feat is not None and feat.shape == normed.shape and feat.shape[-1] == heads * d:
        parts = refit_over_projection(feat, normed, heads, d)  # over the whole projection, OLMo 2's
        raw, place, over = feat.unflatten(-1, (heads, d)).transpose(1, 2), "proj", "proj"
    elif normed.shape != split.shape:
        return None
    elif late_norm(b.order, f"{name}_normed"):
        parts, raw, place = refit_parts(b.ref[f"{name}_rot"], normed), split, "late"
        if parts is None:  # over the rotated projection, every head of a position at once (OLMo 2's, moved late)
            parts = refit_over_projection(merged(b.ref[f"{name}_rot"]), merged(normed), heads, d)
            over = "proj"
    else:
        parts, raw, place = refit_parts(split, normed), split, "head"
    if parts is None:
        return None
    return _Side(name, raw.double(), place, *parts, positions, over)


def _sides(b: Base) -> tuple[_Side, _Side, ReadRope | None] | None:
    if b.raw_keys is not None or "Q_normed" not in b.ref or "K_normed" not in b.ref:
        return None
    q, k = _side(b, "Q"), _side(b, "K")
    return None if q is None or k is None else (q, k, read_rope(b))


def _read(b: Base) -> bool:
    """The reference's qk-norm read from the code (ownnorm.py), not told: its place and axis are the code's
    convention."""
    return b.ctx.spec is not None and b.ctx.spec.qk_norm_read


def _turned(side: _Side, rope: ReadRope | None, x: torch.Tensor) -> torch.Tensor:
    return x if rope is None or side.positions is None else rope_turn(rope)(x, side.positions)


def _run(b: Base, made: dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]],
         v_new: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The replay with q and k (those in `made`: each the heads the scores read, and the steps before them as the
    code holds them) and the values where given."""
    q = made["Q"][0].to(b.q.dtype) if "Q" in made else None
    k = made["K"][0].to(b.k_new.dtype) if "K" in made else None
    steps = replay(b, q=q, k_new=k, v_new=None if v_new is None else v_new.to(b.v_new.dtype))
    for _, held in made.values():
        for step, tensor in held.items():
            if step in b.ref and step not in steps:
                steps[step] = tensor.reshape(b.ref[step].shape) if tensor.numel() == b.ref[step].numel() else tensor
    return steps


def unrotated_sides(b: Base) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Where the reference norms its rotated heads (Hunyuan's query_layernorm after RoPE), each side left unrotated
    and then normed as the reference norms it, the other side as the reference's: (the side's role, the replay)."""
    found = _sides(b)
    if found is None or found[2] is None or found[0].place != "late" or found[1].place != "late":
        return
    for side in (found[1], found[0]):
        late = side.normed(side.raw, side.over)
        yield ROLES[side.name], _run(b, {side.name: (late, {f"{side.name}_rot": side.raw,
                                                             f"{side.name}_normed": late})})


def trials_missing(b: Base) -> Iterator[Trial]:
    """A side never normalized: its heads only rotated, where the reference norms q and k both."""
    found = _sides(b)
    if found is None:
        return
    q, k, rope = found
    made = {}
    for side in (q, k):
        turned = _turned(side, rope, side.raw)
        held = {f"{side.name}_normed": merged(side.raw) if side.place == "proj" else
                turned if side.place == "late" else side.raw, f"{side.name}_split": side.raw}
        if rope is not None:
            held[f"{side.name}_rot"] = turned
        made[side.name] = (turned, held)
    # both left out is the reference without its qk-norm: a mistake only where --qk-norm told it (read from the
    # code, that is the first run's reading, which the code's own norms were read to explain)
    for names in (("K",), ("Q",)) if _read(b) else (("K",), ("Q",), ("Q", "K")):
        which = " and ".join(ROLES[n] for n in names)
        words = (f"the {which} never normalized: {{who}} is what the reference computes with its qk-norm left out of "
                 f"the {which}, where it normalizes q and k both (a norm on one side only tilts every score)")
        yield Trial(_run(b, {n: made[n] for n in names}), words)


def trials_place(b: Base) -> Iterator[Trial]:
    """The norm on the other side of RoPE: after the rotation where the reference norms before it (its gains then
    multiply rotated coordinates), or before it where the reference norms the rotated heads."""
    found = None if _read(b) else _sides(b)
    if found is None or found[2] is None:
        return
    q, k, rope = found
    made = {}
    for side in (q, k):
        over = side.over
        turned = _turned(side, rope, side.raw)
        if side.place == "late":
            early = side.normed(side.raw, over)
            made[side.name] = (_turned(side, rope, early), {f"{side.name}_normed": early,
                                                           f"{side.name}_rot": _turned(side, rope, early)})
            continue
        late = side.normed(turned, over)
        made[side.name] = (late, {f"{side.name}_normed": merged(late) if over == "proj" else late,
                                  f"{side.name}_split": side.raw, f"{side.name}_rot": late})
    before = q.place == "late"
    words = ("the qk-norm applied {how}: {{who}} is what the reference computes with q and k normalized {how}, "
             "where it normalizes them {where}; {why}")
    why = ("with gains, the two orders differ: the norm's weights multiply the coordinates RoPE turns in pairs" +
           (", and over the whole projection each row's mean runs across the rotated heads" if q.over == "proj"
            else ""))
    how, where = ("before RoPE", "after it (the rotated heads)") if before else ("after RoPE", "before it")
    for names in (("Q", "K"), ("K",), ("Q",)):
        said = words.format(how=how + ("" if len(names) == 2 else f" ({' and '.join(ROLES[n] for n in names)} only)"),
                            where=where, why=why)
        yield Trial(_run(b, {n: made[n] for n in names}), said)


def trials_axis(b: Base) -> Iterator[Trial]:
    """The norm over the other axis: each head's d_head where the reference norms the whole projection (OLMo 2's),
    or the whole projection where it norms each head (Qwen3's), with the reference's gains, or the code's where the
    reference's are units (the module holds no norm of the told width: _own_parts)."""
    found = None if _read(b) else _sides(b)
    if found is None:
        return
    q, k, rope = found
    made, split_first = {}, {}
    own = []  # the sides whose gains are the code's own, read from its normed tensor
    for side in (q, k):
        if side.raw.shape[-3] < 2:
            return
        other = "head" if side.over == "proj" else "proj"
        unit = bool(torch.allclose(side.gain, torch.ones_like(side.gain)) and not side.bias.any())
        if unit and (code := _own_parts(b, _turned(side, rope, side.raw) if side.place == "late" else side.raw,
                                        other)):
            side = replace(side, unit=code[0], gain=code[1], bias=code[2])
            own.append(side.name)
        if side.place == "late":
            out = side.normed(_turned(side, rope, side.raw), other)
            made[side.name] = (out, {f"{side.name}_normed": out})
            continue
        normed = side.normed(side.raw, other)
        held = {f"{side.name}_normed": merged(normed) if side.place == "proj" else normed}
        if side.place == "proj":  # the code's heads split from its normed projection, or normed once split
            held[f"{side.name}_split"] = normed
            split_first[side.name] = (_turned(side, rope, normed), {**held, f"{side.name}_split": side.raw})
        made[side.name] = (_turned(side, rope, normed), held)
    wrong, right = ("each head's d_head", "the whole projection, every head's coordinates at once (--qk-norm proj, "
                    "OLMo 2's)") if q.over == "proj" else ("the whole projection, every head's coordinates at "
                                                           "once", "each head's d_head (--qk-norm head)")
    gains = "" if not own else (", with your norms' gains (read from your normed "
                                f"{' and '.join(ROLES[n] for n in own)}: the reference holds no norm of that width)")
    words = (f"the qk-norm over the wrong axis: {{who}} is what the reference computes with q and k normalized over "
             f"{wrong}{gains}, where it normalizes them over {right}")
    for ways in (made, {**made, **split_first}) if split_first else (made,):
        for names in (("Q", "K"), ("K",), ("Q",)):
            yield Trial(_run(b, {n: ways[n] for n in names}), words)


def _own_parts(b: Base, before: torch.Tensor, over: str) -> tuple[Norm, torch.Tensor, torch.Tensor] | None:
    """Where the reference's norm has unit weights (no norm of the told width in the module: `--qk-norm head` on a
    norm over the whole projection, or the mirror), the code's own norm over `over` read from the data flow: the
    latest tensor of the code's that is `before` `[n_batch, heads, n, d]` normalized over `over` (RMSNorm's or
    LayerNorm's unit) times a gain and plus a bias per head and coordinate, held `[n_batch, n, heads·d]` or
    `[n_batch, heads, n, d]` (or any view of them); its unit, gain and bias. None where no tensor is."""
    if before.dim() != 4:
        return None
    n_batch, heads, n, d = before.shape
    for record in reversed(b.ctx.records):  # the latest: a norm's gained rows, not its unit ones before the gain
        t = record.tensor
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() != before.numel():
            continue
        t = t.detach().double()
        for held in (t.reshape(n_batch, n, heads, d).transpose(1, 2), t.reshape(n_batch, heads, n, d)):
            parts = refit_over_projection(merged(before), merged(held), heads, d) if over == "proj" else \
                refit_parts(before, held)
            if parts is not None:
                return parts
    return None


def trials_values_normed(b: Base) -> Iterator[Trial]:
    """The values normalized too, by the keys' norm (never rotated)."""
    found = _sides(b)
    split = b.ref.get("V_split")
    if found is None or split is None or split.shape != found[1].raw.shape or b.names.get("v") != "V_split":
        return
    k = found[1]
    values = k.normed(split, k.over)
    steps = _run(b, {}, v_new=values)
    steps["V_split"] = values
    yield Trial(steps, "the values normalized too: {who} is what the reference computes with V normalized by the "
                "keys' norm; qk-norm normalizes q and k alone, the values stay as projected")
