"""The reference's RoPE read back (base, pairing, positions, fraction, sign, tables) and run again on other
tensors: what the RoPE mistakes and the key/value swaps before a rotation share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnscope.usertrace.rerun import Base, replay


@dataclass
class ReadRope:
    base: float
    pairing: str  # "half" or "interleaved"
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    q: torch.Tensor  # unrotated
    k: torch.Tensor
    rotary: int | None = None  # the coordinates that turn (a fraction of d_head), None: all
    sign: int = 1  # -1: each pair turned by −θ (nanochat's), as the code was read to
    freqs: tuple[float, ...] | None = None  # each pair's frequency, read from the code (ropefreqs.py); None: the base's
    angles: torch.Tensor | None = None  # each position's pair's angle, read from the code (ropefreqs.Angles)
    # the coordinates before the part that turns, passed through: latent attention's no-RoPE part of each head
    # (q and k are then Q_full and K_full unrotated, the rotary parts where the reference joins them)
    lead: int = 0


def read_rope(b: Base) -> ReadRope | None:
    """The reference's RoPE, read back: its base and pairing from the spec, the positions that give its Q_rot and
    K_rot from the unrotated heads (None without RoPE, or where they do not)."""
    spec = b.ctx.spec
    if spec is None or spec.rope_base is None or "Q_rot" not in b.ref or "K_rot" not in b.ref:
        return None
    q, k = b.plain("Q"), b.plain("K")
    if q is None or k is None or q.shape[-1] % 2:
        return None
    pairing = "interleaved" if spec.rope_pairing == "interleaved" else "half"
    fraction = getattr(spec, "rope_fraction", None)
    rotary = int(q.shape[-1] * fraction) if fraction else None
    first = int(getattr(spec, "rope_start", 0) or 0)
    sign = int(getattr(spec, "rope_sign", 1) or 1)
    freqs = getattr(spec, "rope_freqs", None)
    angles = getattr(spec, "rope_angles", None)
    n_K, n_Q, n_new = b.n_K, b.n_Q, int(k.shape[-2])
    q_pos = k_pos = None
    for start in dict.fromkeys((b.n_cache + first, n_K - n_Q + first, first, 0)):
        pos = torch.arange(start, start + n_Q)
        if _near(rotate_pairs(q, pos, spec.rope_base, pairing, rotary=rotary, sign=sign, freqs=freqs, angles=angles),
                 b.ref["Q_rot"]):
            q_pos = pos
            break
    for start in dict.fromkeys((b.n_cache + first, first, 0)):
        pos = torch.arange(start, start + n_new)
        if _near(rotate_pairs(k, pos, spec.rope_base, pairing, rotary=rotary, sign=sign, freqs=freqs, angles=angles),
                 b.ref["K_rot"]):
            k_pos = pos
            break
    if q_pos is None or k_pos is None:
        return None
    return ReadRope(float(spec.rope_base), pairing, q_pos, k_pos, q, k, rotary, sign, freqs, angles)


def read_turns(b: Base) -> ReadRope | None:
    """The reference's RoPE read back as read_rope does, or in latent attention (latentref.py) its rotary parts'
    (latent_rope): what the RoPE mistakes rerun."""
    return read_rope(b) or latent_rope(b)


# latent attention's steps the reading takes: the heads' no-RoPE and rotary parts, before and after the turn
LATENT_PARTS = ("Q_nope", "Q_pe", "Q_pe_rot", "K_nope", "K_pe", "K_pe_rot", "Q_full", "K_full")


def code_base(b: Base, rope: ReadRope) -> float | None:
    """The base the code rotates its queries with (any base), read from its own rotated queries: the last tensor above
    what it hands its scores (else above its last tensor) that is the reference's unrotated queries turned
    (ropefreqs.last_turned, the rotated part alone), each pair's angle at the reference's query positions solved for
    the base (ropefreqs.base_from, inv_freq_i = base^(−2i/r) over the rotated width r). None where none is read: no
    such tensor, a table or angles of the code's own (no base), latent attention's rotary parts."""
    from attnscope.usertrace import ropefreqs
    from attnscope.usertrace.flow import operands

    records = b.ctx.records
    if not records or rope.lead or rope.freqs is not None or rope.angles is not None:
        return None
    handed = operands(records)
    width = rope.rotary or int(rope.q.shape[-1])
    pairing = "half-split" if rope.pairing == "half" else "interleaved"
    # above the queries the scores read, else above the code's last tensor (a kernel given an input as it is)
    found = ropefreqs.last_turned(records, handed[0] if handed else len(records) - 1, rope.q.double(), pairing, width)
    return None if found is None else ropefreqs.base_from(found[1], rope.q_pos, width)


def code_share(b: Base, rope: ReadRope) -> int | None:
    """How many leading coordinates of each head the code turns, read from its own rotated queries: the last tensor
    above what it hands its scores (else above its last tensor) that is the reference's unrotated queries with a
    leading part changed and the rest equal (a rotary fraction's pass-through), the changed part's width rounded up
    to a pair; None where no such tensor is (the whole head turned, or the queries changed otherwise)."""
    from attnscope.usertrace.align import tolerance
    from attnscope.usertrace.flow import operands
    from attnscope.usertrace.ropefreqs import laid_above

    records = b.ctx.records
    if not records or rope.lead:
        return None
    handed = operands(records)
    source = rope.q.double()
    tol = tolerance(source)
    for _, mine in laid_above(records, handed[0] if handed else len(records) - 1, tuple(source.shape)):
        changed = ((mine - source).abs() > tol).flatten(0, -2).any(0)  # [d_head]
        if bool(changed.any()) and not bool(changed.all()):
            width = int(torch.nonzero(changed).max()) + 1
            return width + width % 2
    return None


def latent_rope(b: Base) -> ReadRope | None:
    """Latent attention's RoPE, read back from its data flow: the part of each head that turns is the one Q_pe_rot
    and K_pe_rot are made from (Q_pe, and the rotary key part every head shares), the no-RoPE part before it passes
    through (`lead`); q and k are Q_full and K_full unrotated (the key part repeated for every head). The pairing
    and positions are those that give the reference's rotated parts back (DeepSeek-V3's rope_interleave gathers the
    pairs first and turns them half-split: its Q_pe is the gathered copy). None where they give none back, or where
    the code joins its cache before RoPE (raw_keys)."""
    if b.raw_keys is not None or not set(LATENT_PARTS) <= set(b.ref):
        return None
    q_nope, q_pe, k_nope, k_pe = (b.ref[n] for n in ("Q_nope", "Q_pe", "K_nope", "K_pe"))
    if k_pe.dim() != 3 or q_pe.dim() != 4 or q_pe.shape[-1] % 2:
        return None
    shared = k_pe[:, None].expand(-1, k_nope.shape[-3], -1, -1)  # [n_batch, n_head, n_new, d_rope]
    q, k = torch.cat([q_nope, q_pe], dim=-1), torch.cat([k_nope, shared], dim=-1)  # Q_full, K_full unrotated
    if q.shape != b.q.shape or k.shape != b.k_new.shape:
        return None
    spec = b.ctx.spec
    base = float(spec.rope_base) if spec is not None and spec.rope_base is not None else 10000.0  # latentref's
    n_Q = int(q_pe.shape[-2])
    for pairing in ("interleaved", "half"):
        q_pos = _positions(q_pe, b.ref["Q_pe_rot"], (b.n_cache, b.n_K - n_Q, 0), base, pairing)
        k_pos = _positions(k_pe, b.ref["K_pe_rot"], (b.n_cache, 0), base, pairing)
        if q_pos is not None and k_pos is not None:
            return ReadRope(base, pairing, q_pos, k_pos, q, k, lead=int(q_nope.shape[-1]))
    return None


def _positions(x: torch.Tensor, rotated: torch.Tensor, starts: tuple[int, ...], base: float,
               pairing: str) -> torch.Tensor | None:
    """The positions, from the first of `starts` that does, at which `x` turned so gives `rotated`; None if none."""
    for start in dict.fromkeys(starts):
        pos = torch.arange(start, start + x.shape[-2])
        if _near(rotate_pairs(x, pos, base, pairing), rotated):
            return pos
    return None


def turned(b: Base, rope: ReadRope, q: torch.Tensor, k: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference run again with the queries `q` and new keys `k` (turned another way), with latent attention's
    rotary parts as they turned (Q_pe_rot, K_pe_rot: where the line-up may diverge)."""
    steps = replay(b, q=q, k_new=k)
    if rope.lead:
        steps["Q_pe_rot"], steps["K_pe_rot"] = q[..., rope.lead:], k[:, 0, :, rope.lead:]
    return steps


def rope_turn(rope: ReadRope) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """x `[.., n, d]` at `positions` rotated as the reference's RoPE turns them."""
    return lambda x, positions: rotate_pairs(x, positions, rope.base, rope.pairing, rotary=rope.rotary, sign=rope.sign,
                                        freqs=rope.freqs, angles=rope.angles, lead=rope.lead)


def _near(mine: torch.Tensor, reference: torch.Tensor) -> bool:
    from attnscope.usertrace.align import difference, tolerance

    return tuple(mine.shape) == tuple(reference.shape) and difference(mine, reference) <= \
        tolerance(reference, torch.float32)


def rotate_pairs(x: torch.Tensor, positions: torch.Tensor, base: float, pairing: str, table: str | None = None,
            rotary: int | None = None, over: int | None = None, sign: int = 1,
            freqs: tuple[float, ...] | None = None, angles: torch.Tensor | None = None, lead: int = 0) -> torch.Tensor:
    """x `[.., n, d]` rotated in float64: `pairing` "half" (rotate_half: i with i + r/2) or "interleaved" (2i with
    2i + 1); `table` how the angles are laid along the coordinates ("cat": (θ, θ) as transformers' `cat((freqs,
    freqs))`; "interleave": θ0, θ0, θ1, θ1, ... as `repeat_interleave(2)`), the pairing's own by default; only the
    first `rotary` coordinates rotated (GPT-NeoX's rotary_pct), the rest passed through; `over`: the width the
    frequencies are spread over (the rotated width, as GPT-NeoX's rotary_ndims, unless said); `sign` -1 turns each
    pair by −θ (nanochat's); `freqs`: each pair's frequency, read from the code (ropefreqs.py), in place of the
    base's; `angles`: each position's pair's angle `[n, d/2]` (ropefreqs.Angles), in place of both (positions past
    the table turn by its rows taken cyclically: a trial that no code of the table's tokens reproduces); `lead`: the
    coordinates before the part that turns, passed through as they are (latent attention's no-RoPE part)."""
    x = x.double()
    if lead:
        turned_part = rotate_pairs(x[..., lead:], positions, base, pairing, table, rotary, over, sign, freqs, angles)
        return torch.cat((x[..., :lead], turned_part), dim=-1)
    r = x.shape[-1] if rotary is None else rotary
    inv_freq = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / (over or r)) if freqs is None \
        else torch.tensor(freqs, dtype=torch.float64)  # [r/2]
    angle = sign * positions.double()[:, None] * inv_freq if angles is None \
        else sign * angles.double()[positions.long() % angles.shape[0], : r // 2]  # [n, r/2]
    table = table or ("cat" if pairing == "half" else "interleave")
    theta = torch.cat((angle, angle), -1) if table == "cat" else angle.repeat_interleave(2, -1)  # [n, r]
    part, rest = x[..., :r], x[..., r:]
    if pairing == "half":
        turned = torch.cat((-part[..., r // 2:], part[..., : r // 2]), dim=-1)
    else:
        turned = torch.stack((-part[..., 1::2], part[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat((part * theta.cos() + turned * theta.sin(), rest), dim=-1)


def rejoined(b: Base, q: torch.Tensor, turn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None, *,
              keys: torch.Tensor | None = None, values: torch.Tensor | None = None, start: int = 0,
              new_first: bool = False, swapped: str = "", turn_values: bool = False) -> dict[str, torch.Tensor]:
    """The reference run again as code that joins its cache before RoPE does (rerun.Base.raw_keys): the cached keys
    before RoPE joined with the new `keys` before it (the reference's unrotated ones by default), the join turned
    at positions start .. start + n_K − 1 by `turn` (None: not rotated), the values joined likewise. `new_first`:
    the new ones joined before the cached ones; `swapped` "join": keys and values swapped once joined, before the
    rotation, "turned": after it; `turn_values`: the joined values rotated as the keys are."""
    assert b.raw_keys is not None and b.cache is not None
    keys = b.plain("K") if keys is None else keys
    values = b.v_new if values is None else values
    assert keys is not None
    parts = [(b.raw_keys, keys), (b.cache[1], values)]
    k_cat, v_cat = (torch.cat(p[::-1] if new_first else p, dim=-2) for p in parts)
    positions = torch.arange(start, start + k_cat.shape[-2])
    if swapped == "join":
        k_cat, v_cat = v_cat, k_cat
    if turn is not None:
        k_cat = turn(k_cat, positions)
        if turn_values:
            v_cat = turn(v_cat, positions)
    if swapped == "turned":
        k_cat, v_cat = v_cat, k_cat
    n_new = keys.shape[-2]
    rows = slice(0, n_new) if new_first else slice(k_cat.shape[-2] - n_new, None)
    return replay(b, q=q, k_new=k_cat[..., rows, :], v_new=v_cat[..., rows, :], joined=(k_cat, v_cat))
