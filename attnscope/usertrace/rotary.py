"""The classic RoPE mistakes, told by the numbers: each alternative rotation is computed from the reference's
own unrotated Q_split / K_split and compared with the user's tensor.

The alternatives are written here, small and in float64, rather than taken from attnscope.variants.rope (which computes
the reference's pairing, half-split or --rope-pairing interleaved): the diagnosis needs rotations the reference
never makes (another base, positions from 0, the other pairing).

- half-split pairing (transformers' LLaMA `rotate_half`: coordinate i with i + d/2) against interleaved
  (GPT-J, Meta's `llama/model.py` `view_as_complex(x.reshape(..., -1, 2))`: 2i with 2i + 1);
- the base (a config's `rope_theta`): fitted from the angle pair 1 turns at the first positions, then checked
  by rotating with it;
- positions in a decode step: new tokens at n_cache + i, not i;
- not rotated at all;
- RoPE applied to the values too: a user tensor is V_split (or V_rep) rotated as the keys are;
- RoPE after the head repeat is no mistake: keys repeated for the query heads first, rotated after (lit-gpt's
  `CausalSelfAttention` of 2023 expands k and v, then `apply_rope`s) give the numbers rotating first gives, at
  n_group times the rotation's work (transformers' LlamaAttention rotates, caches, then `repeat_kv`s): a note.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace.diagnosis import Context, Diagnosis, close, equal_record, in_reference_layout, label_of

if TYPE_CHECKING:
    from attnscope.usertrace.align import Match

ROTATED = {"Q_rot": ("Q_split", "Q"), "K_rot": ("K_split", "K")}
KNOWN_BASES = (10000.0, 500000.0, 1000000.0, 100000.0, 50000.0, 1000.0, 100.0)
PAIRINGS = {"interleaved": "interleaved, (0, 1), (2, 3), ... (GPT-J, Meta's view_as_complex)",
            "half": "half-split, (i, i + d_head/2), as transformers' LLaMA rotate_half does"}


def rotate(x: torch.Tensor, positions: torch.Tensor, base: float, pairing: str = "half") -> torch.Tensor:
    """x `[.., n, d]` rotated at `positions` `[n]` with `base`, in float64: half-split pairs i with i + d/2,
    interleaved pairs 2i with 2i + 1; pair i turns by position · base^(-2i/d)."""
    x = x.double()
    d = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    angle = positions.double()[:, None] * inv_freq  # [n, d/2]
    cos, sin = angle.cos(), angle.sin()
    if pairing == "half":
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def diagnose_rope(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    if near is None or step not in ROTATED or ctx.spec is None or ctx.spec.rope_base is None:
        return None
    source = next((s for s in ROTATED[step] if s in ctx.reference), None)
    if source is None:
        return None
    x = ctx.reference[source].double()
    user = in_reference_layout(near, step, ctx)
    if tuple(user.shape) != tuple(x.shape):
        return None
    base, n = ctx.spec.rope_base, x.shape[-2]
    start = _start(step, ctx)
    positions = torch.arange(start, start + n)
    who, what = label_of(near.record), "queries" if step == "Q_rot" else "keys"
    ours = "interleaved" if ctx.spec.rope_pairing == "interleaved" else "half"  # the reference's pairing
    other = "half" if ours == "interleaved" else "interleaved"
    if close(user, rotate(x, positions, base, other)):
        return Diagnosis(f"{who} pairs RoPE's coordinates {PAIRINGS[other]}, where the reference pairs them "
                         f"{PAIRINGS[ours]}; the two agree only once the q and k weights' rows are permuted "
                         "(transformers' convert_llama_weights_to_hf); if your weights are laid out for yours, "
                         + ("pass --rope-pairing interleaved" if other == "interleaved" else
                            "drop --rope-pairing interleaved (half-split is the default)"), near.record)
    if start and close(user, rotate(x, torch.arange(n), base, ours)):
        return Diagnosis(f"positions not offset in a decode step: {who} rotates the {n} new {what} at positions "
                         f"0 to {n - 1}, but after {ctx.spec.cache or start} cached positions they sit at {start} to "
                         f"{start + n - 1}; add the cache's length to the positions (cos[start:start + n], "
                         "freqs_cis[start_pos : start_pos + seqlen])", near.record)
    for pairing in (ours, other):
        fitted = fit_base(x, user, positions, pairing)
        if fitted is not None and not math.isclose(fitted, base, rel_tol=1e-3):
            pairs = "" if pairing == ours else f", and pairs its coordinates {PAIRINGS[pairing]}"
            return Diagnosis(f"{who} rotates with RoPE base {fitted:g} where the reference uses {base:g}{pairs}: "
                             f"pair i turns by position · {fitted:g}^(-2i/d_head); if your model was trained with "
                             f"rope_theta = {fitted:g}, pass --rope-base {fitted:g}, else fix the base", near.record)
    return None


def not_rotated(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    """Asked after every other candidate was tried for a wrong rotation: the unrotated input itself."""
    if near is None or step not in ROTATED or ctx.spec is None or ctx.spec.rope_base is None:
        return None
    source = next((s for s in ROTATED[step] if s in ctx.reference), None)
    if source is None or not close(in_reference_layout(near, step, ctx), ctx.reference[source].double()):
        return None
    what = "queries" if step == "Q_rot" else "keys"
    turned = _turned_otherwise(step, ctx, ctx.reference[source])
    if turned is not None:  # rotated all the same, by angles of its own: RoPE is applied, not as the reference's
        return Diagnosis(f"{label_of(turned)} is {source} rotated, but not as the reference rotates it (--rope, base "
                         f"{ctx.spec.rope_base:g}): the {what} turn by other angles or at another scale (another "
                         "base, scaling, attention factor or positions), so RoPE is applied, not as the reference "
                         "applies it", turned)
    changed = _changed_otherwise(step, ctx, ctx.reference[source])
    if changed is not None:  # the scores read something else: neither the unrotated tensor nor any pair-wise turn
        return Diagnosis(f"{label_of(changed)} is what your code hands the scores as its {what}: neither {source} "
                         f"nor {source} turned pair by pair by one table of angles (a RoPE, in either pairing): your "
                         f"code changes the {what}, but in a way trace reads as no RoPE (--rope, base "
                         f"{ctx.spec.rope_base:g}): a pair's two coordinates turned by different angles, say, or "
                         "angles that differ from head to head", changed)
    return Diagnosis(f"{label_of(near.record)} is {source} not rotated, and no tensor of yours is {source} rotated: "
                     f"RoPE is never applied to the {what} (the reference rotates them, --rope, base "
                     f"{ctx.spec.rope_base:g})", near.record)


def _changed_otherwise(step: str, ctx: Context, source: torch.Tensor) -> Any:
    """The nearest tensor at or above what the code hands its scores (the queries for Q_rot, the keys for K_rot)
    that holds as many numbers as `source`, where in no layout is it `source` or `source` times one number (code
    that scales q before the product): the code changed the unrotated tensor, not by a rotation (_turned_otherwise
    is asked first); None where that tensor is `source` (RoPE never applied) or none is found."""
    from attnscope.usertrace import ropefreqs
    from attnscope.usertrace.flow import operands

    handed = operands(ctx.records)
    if handed is None:
        return None
    x = source.double()
    nearest = None
    for record, mine in ropefreqs.laid_above(ctx.records, handed[0] if step == "Q_rot" else handed[1],
                                             tuple(source.shape)):
        if nearest is not None and record is not nearest:
            return nearest  # every layout of the nearest tensor tried: none is the unrotated source
        nearest = record
        ratio = float((mine * x).sum() / (x * x).sum().clamp_min(1e-300))
        if close(mine, ratio * x):
            return None
    return nearest


def _turned_otherwise(step: str, ctx: Context, source: torch.Tensor) -> Any:
    """The code's tensor above what it hands its scores (the queries for Q_rot, the keys for K_rot) that is `source`
    rotated, by any angles (ropefreqs.last_turned), where some pair turns; None otherwise."""
    from attnscope.usertrace import ropefreqs
    from attnscope.usertrace.flow import operands

    handed = operands(ctx.records)
    if handed is None or source.dim() < 2 or source.shape[-1] % 2:
        return None
    index = handed[0] if step == "Q_rot" else handed[1]
    for pairing in ("half-split", "interleaved"):
        found = ropefreqs.last_turned(ctx.records, index, source.double(), pairing)
        if found is not None and float(found[1].abs().max()) > ropefreqs.STILL:
            return found[0]
    return None


def untold(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    """At the scores and after, where no cause fits and the reference has no RoPE: the code hands its scores queries
    and keys rotated by a RoPE (any frequencies, ropefreqs.py) that the reference was not told of; something else
    differs too (rope.untold's rerun would give them back otherwise)."""
    from attnscope.usertrace import ropefreqs

    if near is None or step not in ("scores", "masked_scores", "attention", "x_raw") or ctx.spec is None \
            or ctx.spec.rope_base is not None or "scores" not in ctx.reference:
        return None
    q = next((ctx.reference[s] for s in ("Q_split", "Q") if s in ctx.reference), None)
    k = next((ctx.reference[s] for s in ("K_split", "K") if s in ctx.reference), None)
    if q is None or k is None or q.dim() < 2 or q.shape[-1] % 2:
        return None
    read = ropefreqs.from_code(ctx.records, q, k, ctx.spec.cache)
    if read is None:
        return None
    table, pairing = read
    hint = " --rope-pairing interleaved" if pairing == "interleaved" else ""
    return Diagnosis(f"your code rotates q and k by RoPE, which the reference was not told of ({table.words()}; "
                     f"pairing {pairing}), and something else differs as well: describe the RoPE with --rope{hint} "
                     "(its frequencies are then read from your code), and trace names what is left", near.record)


def on_values(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    """A whole cause, at the values and after: some user tensor is the reference's values rotated."""
    if ctx.spec is None or ctx.spec.rope_base is None or step in ("Q_feat", "K_feat", "V_feat", "Q_rot", "K_rot"):
        return None
    for source in ("V_split", "V_rep", "V_cat"):
        if source not in ctx.reference or ctx.reference[source].dim() < 2 or ctx.reference[source].shape[-1] % 2:
            continue  # values of an odd width (latent attention's d_V) have no pairs to turn
        v = ctx.reference[source].double()
        start = 0 if source == "V_cat" else _start("K_rot", ctx)  # the new values sit after the cache
        positions = torch.arange(start, start + v.shape[-2])
        for pairing in ("half", "interleaved"):
            record = equal_record(ctx.records, rotate(v, positions, ctx.spec.rope_base, pairing))
            if record is not None:
                return Diagnosis(f"RoPE applied to the values: {label_of(record)} is {source} rotated as the "
                                 "keys are; RoPE rotates only the queries and the keys (their dot products then "
                                 "depend on the distance i − j), the values are taken as they are", record)
    return None


def after_repeat(ctx: Context) -> str | None:
    """The note for keys the code rotates after the head repeat (no rotated, unrepeated keys, but the repeated keys
    rotated after the repeat are there): RoPE turns every head alike, so the order changes no number."""
    from attnscope.usertrace.align import best_equal

    if "K_rep" not in ctx.reference or "K_split" not in ctx.reference:
        return None
    n_group = ctx.reference["K_rep"].shape[-3] // ctx.reference["K_split"].shape[-3]
    repeated = ctx.reference["K_split"].repeat_interleave(n_group, dim=-3)  # unrotated, repeated
    before = best_equal(ctx.records, repeated, None)
    rotated = best_equal(ctx.records, ctx.reference["K_rep"], None)
    if before is None or rotated is None or rotated.record.index < before.record.index:
        return None
    repeats, rotates = label_of(before.record), label_of(rotated.record)
    return (f"RoPE after the head repeat: {repeats} repeats the unrotated keys for the {n_group} query heads of "
            f"each key/value head and {rotates} rotates them after (lit-gpt's order); RoPE turns every head "
            f"alike, so the numbers are the reference's (it equals K_rep), at {n_group} times the rotation's work: "
            "a convention, not a mistake (transformers' LlamaAttention rotates, then repeat_kv's)")


def _start(step: str, ctx: Context) -> int:
    """Where the reference's queries (or new keys) start: after the cache, or lower-right's offset."""
    spec, sizes = ctx.spec, ctx.sizes
    assert spec is not None
    if spec.cache:
        return spec.cache
    if step == "Q_rot" and spec.causal == "lower-right":
        return sizes.get("n_K", 0) - sizes.get("n_Q", 0)
    return 0


def fit_base(x: torch.Tensor, user: torch.Tensor, positions: torch.Tensor, pairing: str) -> float | None:
    """The base under which `user` is `x` rotated (`[.., n, d]` at `positions`): each pair's angle read
    (ropefreqs.turned_by), the base solved from them (ropefreqs.base_from: any base, inv_freq_i = base^(−2i/d)),
    then checked by rotating with it."""
    from attnscope.usertrace import ropefreqs

    if x.shape[-1] < 4 or x.shape != user.shape:
        return None
    angles = ropefreqs.turned_by(x.double(), user.double(), "half-split" if pairing == "half" else "interleaved")
    base = None if angles is None else ropefreqs.base_from(angles, positions, x.shape[-1])
    return base if base is not None and close(user, rotate(x, positions, base, pairing)) else None
