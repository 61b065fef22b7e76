"""The catalog's RoPE mistakes: the other pairing, positions from 0 in a decode step, another base or fraction,
never applied, untold, applied to the values."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from attnscope.usertrace.rerun import Base, replay
from attnscope.usertrace.roperead import (
    ReadRope,
    code_base,
    code_share,
    read_rope,
    read_turns,
    rejoined,
    rope_turn,
    rotate_pairs,
    turned,
)
from attnscope.usertrace.trials import Trial


def _rotated(b: Base, rope: ReadRope, q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
             base: float | None = None, pairing: str | None = None, table: str | None = None,
             rotary: int | None = None, over: int | None = None, lead: int | None = None,
             freqs: tuple[float, ...] | None = None) -> dict[str, torch.Tensor]:
    """The reference run again with its queries and keys rotated another way (the rest as the reference's); `lead`:
    the coordinates before the part that turns, passed through (the reference's own where not given); `freqs`: each
    pair's frequency (another base under the scaling the module declares)."""
    own = base is None and rotary is None and over is None and freqs is None  # the code's own table
    freqs, angles = (rope.freqs, rope.angles) if own else (freqs, None)
    base, pairing, rotary = base or rope.base, pairing or rope.pairing, rotary or rope.rotary

    def turn(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return rotate_pairs(x, positions, base, pairing, table, rotary, over, rope.sign, freqs, angles,
                            rope.lead if lead is None else lead)

    q = turn(rope.q, rope.q_pos if q_pos is None else q_pos)
    k_pos = rope.k_pos if k_pos is None else k_pos
    if b.raw_keys is not None:  # the code rotates the joined keys: the cached ones turn the same way
        return rejoined(b, q, turn, start=int(k_pos[0]) - b.n_cache)
    return turned(b, rope, q, turn(rope.k, k_pos))


PAIRS = {"half": "half-split, (i, i + d_head/2), as transformers' LLaMA rotate_half does",
         "interleaved": "interleaved, (0, 1), (2, 3), ... (GPT-J, Meta's view_as_complex)"}


TABLES = {"cat": "a half-split table (cat((freqs, freqs)), each angle on i and i + d_head/2)",
          "interleave": "an interleaved table (freqs.repeat_interleave(2), each angle on 2i and 2i + 1)"}


def trials_pairing(b: Base) -> Iterator[Trial]:
    if "Q_pe_rot" in b.ref:  # latent attention (usertrace/latentref.py): its rotary parts alone turn
        yield from _latent_pairing(b)
        return
    rope = read_rope(b)
    if rope is None:
        return
    other = "interleaved" if rope.pairing == "half" else "half"
    asked = b.ctx.spec is not None and b.ctx.spec.pairing_asked and b.ctx.spec.rope_pairing == "interleaved"
    # only a flag the user gave is one to drop; else the one that asks for the code's pairing
    hint = ("pass --rope-pairing interleaved" if other == "interleaved" else
            "drop --rope-pairing interleaved (half-split is the default)" if asked else
            "pass --rope-pairing half-split")
    yield Trial(_rotated(b, rope, pairing=other), f"{{who}} pairs RoPE's coordinates {PAIRS[other]}, where the "
                f"reference pairs them {PAIRS[rope.pairing]}; the two "
                "agree only once the q and k weights' rows are permuted (transformers' convert_llama_weights_to_hf); "
                f"if your weights are laid out for yours, {hint}")
    for pairing, table in (("half", "interleave"), ("interleaved", "cat")):
        yield Trial(_rotated(b, rope, pairing=pairing, table=table), f"RoPE's tables and pairing do not go together: "
                    f"{{who}} equals the queries and keys rotated {PAIRS[pairing].split(',')[0]} with {TABLES[table]}, "
                    f"so pair i turns by another pair's angle; the reference rotates {PAIRS[rope.pairing]}; build the "
                    "cos/sin tables for the pairing your rotation uses")


def _latent_pairing(b: Base) -> Iterator[Trial]:
    """rope.pairing in latent attention: the rotary parts as the checkpoint holds them (Q_split's last d_rope
    coordinates, KV_feat's past the latent) turned with the pairing the reference does not use, where they lie, and
    joined to the no-RoPE parts (the rotated key part every head's), from position 0 (no cache)."""
    spec = b.ctx.spec
    if spec is None or spec.rope_base is None or b.cache is not None or not {"Q_split", "KV_feat", "KV_latent",
                                                                            "Q_nope", "K_nope"} <= set(b.ref):
        return
    d_nope, d_latent = b.ref["Q_nope"].shape[-1], b.ref["KV_latent"].shape[-1]
    q_pe = b.ref["Q_split"][..., d_nope:]  # [n_batch, n_head, n_Q, d_rope]
    k_pe = b.ref["KV_feat"][..., d_latent:]  # [n_batch, n_K, d_rope]
    n_head = b.ref["K_nope"].shape[-3]
    for pairing in ("half", "interleaved"):
        q_rot = rotate_pairs(q_pe, torch.arange(q_pe.shape[-2]), spec.rope_base, pairing)
        k_rot = rotate_pairs(k_pe, torch.arange(k_pe.shape[-2]), spec.rope_base, pairing)  # [n_batch, n_K, d_rope]
        shared = k_rot[:, None].expand(-1, n_head, -1, -1)
        steps = replay(b, q=torch.cat([b.ref["Q_nope"], q_rot], dim=-1),
                       k_new=torch.cat([b.ref["K_nope"], shared], dim=-1))
        steps["Q_pe_rot"] = q_rot
        yield Trial(steps, f"{{who}} turns the rotary parts {PAIRS[pairing]}, where the reference turns the "
                    f"checkpoint's pairs {LATENT_PAIRS[pairing]}; if your weights are laid out for yours, pass "
                    f"--rope-pairing {'half-split' if pairing == 'half' else 'interleaved'}")


LATENT_PAIRS = {"half": "interleaved, as DeepSeek-V2/V3 do (as complex numbers, or gathered even then odd first)",
                "interleaved": "half-split, as MiniCPM3 does"}


def trials_positions(b: Base) -> Iterator[Trial]:
    rope = read_turns(b)
    if rope is None or not b.n_cache:
        return
    n = b.n_Q
    if b.raw_keys is not None:  # the code rotates the joined keys: the cached ones at 0 .. n_cache − 1
        yield from _joined_positions(b, rope)
        return
    for what, k_pos in (("queries", None), ("queries and keys", torch.arange(rope.k.shape[-2]))):
        yield Trial(_rotated(b, rope, q_pos=torch.arange(n), k_pos=k_pos), f"positions not offset in a decode step: "
                    f"{{who}} rotates the {n} new {what} at positions 0 to {n - 1}, but after {b.n_cache} cached "
                    f"positions they sit at {b.n_cache} to {b.n_cache + n - 1}; add the cache's length to the "
                    "positions (cos[start:start + n], freqs_cis[start_pos : start_pos + seqlen])")


def _joined_positions(b: Base, rope: ReadRope) -> Iterator[Trial]:
    """rope.positions where the code joins its cache before RoPE: the queries rotated from 0, or the joined keys
    rotated from the cache's length (the offset a decode step adds given to the whole join, cached keys and all)."""
    n, n_K, past = b.n_Q, b.n_K, b.n_cache
    yield Trial(_rotated(b, rope, q_pos=torch.arange(n)), f"positions not offset in a decode step: {{who}} rotates "
                f"the {n} new queries at positions 0 to {n - 1}, but after {past} cached positions they sit at {past} "
                f"to {past + n - 1}, as the last {n} of the {n_K} joined keys do; rotate the queries with the table's "
                f"last {n} rows (cos[n_K - n_Q:n_K])")
    for what, q_pos in (("", None), (" and the queries with them", rope.q_pos + past)):
        yield Trial(_rotated(b, rope, q_pos=q_pos, k_pos=rope.k_pos + past), f"positions offset twice in a decode "
                    f"step: {{who}} rotates the {n_K} joined keys (the {past} cached ones and the {n_K - past} new) "
                    f"at positions {past} to {past + n_K - 1}{what}, as though they all came after the cache; the "
                    f"joined keys sit at 0 to {n_K - 1} (the table's first n_K rows, cos[:n_K])")


def trials_base(b: Base) -> Iterator[Trial]:
    """Another base: the one the code's own rotated queries turn at (roperead.code_base, any base); where none is
    read from them (latent attention's rotary parts), the usual ones (rotary.KNOWN_BASES)."""
    from attnscope.usertrace.rotary import KNOWN_BASES

    rope = read_turns(b)
    if rope is None:
        return
    own = b.ctx.spec is not None and b.ctx.spec.base_from_module
    where = _where(b)
    read = code_base(b, rope)
    for base in [read] if read is not None else KNOWN_BASES:
        if math.isclose(base, rope.base, rel_tol=1e-9):
            continue
        if own:  # the module says its base, and rotates with another: a bug, whatever the model
            words = (f"{{who}} rotates with RoPE base {base:g} where your module says {rope.base:g} ({where}): the "
                     f"base is not handed on to where the rotation's frequencies are made "
                     f"(base ** (-2i / d_head) with base = {base:g}); pass the module's own")
        else:
            words = (f"{{who}} rotates with RoPE base {base:g} where the reference uses {rope.base:g}; if your model "
                     f"was trained with rope_theta = {base:g}, pass --rope-base {base:g}, else fix the base")
        yield Trial(_rotated(b, rope, base=base), words)
    yield from _declared_base(b, rope, own)
    yield from _scaled_base(b, rope, own)


def _declared_base(b: Base, rope: ReadRope, own: bool) -> Iterator[Trial]:
    """rope.base under the RoPE scaling the module declares (llama3's, yarn's: spec.rope_declared): the usual bases'
    frequencies as that scaling moves them, where the reference turns at the declared ones."""
    from dataclasses import replace

    from attnscope.errors import AttnscopeError
    from attnscope.usertrace.rotary import KNOWN_BASES

    declared = b.ctx.spec.rope_declared if b.ctx.spec is not None else None
    if declared is None or rope.angles is not None or rope.rotary is not None or rope.lead:
        return
    d, n = int(rope.q.shape[-1]), int(max(int(rope.q_pos.max()), int(rope.k_pos.max())) + 1)
    for base in KNOWN_BASES:
        if math.isclose(base, rope.base, rel_tol=1e-9):
            continue
        try:
            freqs = tuple(float(f) for f in replace(declared, base=base).inv_freq(d, n))
        except AttnscopeError:
            continue
        said = f"your module says {rope.base:g} ({_where(b)})" if own else f"the reference uses {rope.base:g}"
        yield Trial(_rotated(b, rope, freqs=freqs), f"{{who}} rotates with RoPE base {base:g} under its rope_scaling "
                    f"({declared.kind}), where {said}: the base is not handed on to where the scaled frequencies are "
                    "made; pass the model's own")


def _where(b: Base) -> str:
    """Where the module says the reference's RoPE base (its config's rope_theta, its attribute ...), in words."""
    return (b.ctx.spec.base_where if b.ctx.spec is not None else "") or "its rope_theta or base"


def _scaled_base(b: Base, rope: ReadRope, own: bool) -> Iterator[Trial]:
    """rope.base under linear scaling: the queries and keys the code hands its scores turn at another base's
    frequencies over one factor (positions t / f; both solved from the code's frequencies, ropefreqs.scaled_base),
    where the reference's base (over that factor, a convention) does not give them."""
    from dataclasses import replace

    from attnscope.usertrace import ropefreqs

    if rope.freqs is not None or rope.angles is not None or rope.rotary is not None or rope.lead or b.n_cache:
        return
    read = ropefreqs.from_code(b.ctx.records, rope.q, rope.k, 0)
    if read is None or read[0].sign != rope.sign or (read[1] == "interleaved") != (rope.pairing == "interleaved"):
        return
    table = read[0]
    found = ropefreqs.scaled_base(table, rope.q.shape[-1])
    if found is not None and not math.isclose(found[0], rope.base, rel_tol=1e-6):
        base, factor = found
        scaled = f"RoPE base {base:g}, positions scaled by 1/{factor:g} (its linear RoPE scaling),"
        words = (f"{{who}} rotates with {scaled} where your module says base {rope.base:g} ({_where(b)}): "
                 "the base is not handed on to where the rotation's frequencies are made; pass the module's own"
                 if own else f"{{who}} rotates with {scaled} where the reference uses base {rope.base:g}; if your "
                 f"model was trained with rope_theta = {base:g}, pass --rope-base {base:g}, else fix the base")
        yield Trial(_rotated(b, replace(rope, freqs=table.freqs)), words)


def trials_fraction(b: Base) -> Iterator[Trial]:
    """A rotary fraction where the reference rotates all (or the other way round), and a fraction whose
    frequencies are spread over the whole head instead of the rotated part."""
    rope = read_rope(b)
    if rope is None:
        return
    d = b.d_head
    if rope.rotary is not None:
        r = rope.rotary
        yield Trial(_rotated(b, rope, over=d), f"RoPE's frequencies are spread over the whole head: {{who}} is what "
                    f"the reference computes with the first {r} of d_head = {d} coordinates turning at base^(-2i / "
                    f"{d}) where a rotary fraction turns them at base^(-2i / {r}) (GPT-NeoX's inv_freq over "
                    "rotary_ndims)")
        if not rope.lead and r < d:
            yield _last_share(b, rope, r)
        said = b.ctx.spec is not None and b.ctx.spec.fraction_from_module
        yield Trial(_rotated(b, rope, rotary=d), f"RoPE rotates the whole head: {{who}} is what the reference computes "
                    f"with all d_head = {d} coordinates rotated, where only the first {r} turn (a rotary fraction of "
                    f"{r / d:g}) and the rest pass through" + (
                        " (your module's config says so: its rotary_dim, rotary_pct or partial_rotary_factor); "
                        "rotate the first rotary_dim coordinates of each head" if said else ""))
        if said:  # the share the module says, and code that rotates a share of another size (its own, read)
            for w in _other_shares(b, rope, r):
                yield Trial(_rotated(b, rope, rotary=w), f"RoPE rotates a share of another size: {{who}} is what the "
                            f"reference computes with the first {w} of d_head = {d} coordinates rotated (a rotary "
                            f"fraction of {w / d:g}), where your module says the first {r} (a rotary fraction of "
                            f"{r / d:g}: its rotary_dim, rotary_pct or partial_rotary_factor, or its config's); "
                            "rotate the share it says")
        return
    said = b.ctx.spec is not None and b.ctx.spec.fraction_from_module  # the config says the whole head turns
    for r in _other_shares(b, rope, d) if said else dict.fromkeys(int(d * share) for share in (0.25, 0.5)):
        share = r / d
        if r >= 2 and r % 2 == 0:
            yield Trial(_rotated(b, rope, rotary=r), f"RoPE rotates only part of each head: {{who}} is what the "
                        f"reference computes with the first {r} of d_head = {d} coordinates rotated (a rotary "
                        f"fraction of {share:g}, GPT-NeoX's rotary_pct) and the rest passed through, where the "
                        + ("reference rotates all of them" if not said else "the whole head turns (your module's "
                           "config says so; the module's own rotary attribute says otherwise)"))
            yield Trial(_rotated(b, rope, rotary=r, over=d), f"RoPE's frequencies are spread over the whole head: "
                        f"{{who}} is what the reference computes with the first {r} of d_head = {d} coordinates "
                        f"turning at base^(-2i / {d}) where a rotary fraction turns them at base^(-2i / {r}) "
                        "(GPT-NeoX's inv_freq over rotary_ndims)")


def _last_share(b: Base, rope: ReadRope, r: int) -> Trial:
    """The rotary share taken from the end of each head (`q[..., -rotary_ndims:]` turned, the first d_head − r
    passed through) where a rotary fraction turns the first r (GPT-NeoX's, StableLM's `q[..., :rotary_ndims]`): the
    same tables and pairing, on the other coordinates."""
    d = b.d_head
    return Trial(_rotated(b, rope, lead=d - r), f"RoPE rotates the wrong share of each head: {{who}} is what the "
                 f"reference computes with the last {r} of d_head = {d} coordinates rotated and the first {d - r} "
                 f"passed through, where a rotary fraction turns the first {r} (`x[..., :rotary_ndims]`) and passes "
                 "the rest through")


def _other_shares(b: Base, rope: ReadRope, said: int) -> list[int]:
    """The widths to try where the module says `said` coordinates of each head turn: the one the code turns, read
    from its rotated queries (roperead.code_share), else every even width."""
    read = code_share(b, rope)
    if read is not None:
        return [read] if read != said and read < b.d_head else []
    return [w for w in range(2, b.d_head, 2) if w != said]


def trials_on_values(b: Base) -> Iterator[Trial]:
    yield from _values_from_turned_input(b)
    rope = read_rope(b)
    if rope is None or b.v_new.shape[-1] % 2:
        return
    if b.raw_keys is not None:  # the joined values rotated with the joined keys
        steps = rejoined(b, b.q, rope_turn(rope),
                          start=int(rope.k_pos[0]) - b.n_cache, turn_values=True)
    else:
        steps = replay(b, v_new=rope_turn(rope)(b.v_new, rope.k_pos))
    yield Trial(steps,
                "RoPE applied to the "
                "values: {who} is what the reference computes with V rotated as the keys are; RoPE rotates only the "
                "queries and the keys (their dot products then depend on the distance i − j), the values are "
                "taken as they are")


def _values_from_turned_input(b: Base) -> Iterator[Trial]:
    """The values projected from the input turned by position that the queries' and keys' projections read
    (qkinput.py: RoPE on the input), where the reference's values read the input as it is."""
    from attnscope.usertrace.kvtrials import by_other_weights, heads_of
    from attnscope.usertrace.qkinput import turned_by_position

    inputs = b.ctx.inputs
    if inputs is None or inputs.own_from != "position" or "Q" not in inputs.own or "V" in inputs.own:
        return
    xs = inputs.qkv()
    if not turned_by_position(xs[0], xs[2]):
        return
    made = by_other_weights(b, "v", 0)
    heads = heads_of(made[0], b.v_new, b.strided) if made is not None else None
    if made is None or heads is None:
        return
    steps = replay(b, v_new=heads)
    steps["V_feat"] = made[0]
    yield Trial(steps, f"RoPE applied to the values: {{who}} is what the reference computes with the values projected "
                f"({made[1]}) from the input turned by position that your queries' and keys' projections read, where "
                "the values are projected from the input as it is; RoPE rotates only the queries and the keys (their "
                "dot products then depend on the distance i − j)")


def trials_not_applied(b: Base) -> Iterator[Trial]:
    rope = read_turns(b)
    if rope is not None:
        steps = rejoined(b, rope.q, None) if b.raw_keys is not None else turned(b, rope, rope.q, rope.k)
        what = "the rotary parts of the queries and keys" if rope.lead else "the queries and keys"
        spec = b.ctx.spec
        how = "by the angles your code turns its queries by (its own table)" \
            if spec is not None and spec.rope_angles is not None else f"--rope, base {rope.base:g}"
        yield Trial(steps, f"RoPE is never applied: {{who}} is what the reference computes "
                    f"with {what} not rotated (the reference rotates them, {how})")
        if rope.lead or b.raw_keys is not None:
            return
        from attnscope.usertrace.normtrials import unrotated_sides

        turn = rope_turn(rope)  # one side rotated, the other left as projected (a rotation forgotten on one line)
        sides = list(unrotated_sides(b)) or [  # a qk-norm on the rotated heads norms the unrotated side too
            ("keys", turned(b, rope, turn(rope.q, rope.q_pos), rope.k)),
            ("queries", turned(b, rope, rope.q, turn(rope.k, rope.k_pos)))]
        for side, steps in sides:
            other = "queries" if side == "keys" else "keys"
            yield Trial(steps, f"RoPE is never applied to the {side}: {{who}} is what the reference "
                        f"computes with the {other} rotated and the {side} not (the reference rotates both, {how}; "
                        "a rotation on one side alone makes the scores depend on each position, not on the distance "
                        "i − j)")


def trials_untold(b: Base) -> Iterator[Trial]:
    from attnscope.usertrace import ropefreqs

    spec = b.ctx.spec
    if spec is None or spec.rope_base is not None or b.names["q"] not in ("Q_split", "Q", "Q_normed") or b.col \
            or b.d_head % 2:
        return
    if b.names["k"] not in ("K_split", "K", "K_normed"):
        return
    q_pos = torch.arange(b.n_cache, b.n_cache + b.n_Q)
    k_pos = torch.arange(b.n_cache, b.n_cache + b.k_new.shape[-2])
    read = ropefreqs.from_code(b.ctx.records, b.q, b.k_new, b.n_cache) if not b.n_cache else None
    if read is not None:  # RoPE of the code's own frequencies, read from the queries and keys it hands its scores
        table, pairing = read
        turn = "half" if pairing == "half-split" else "interleaved"
        base = table.base()
        other = base is not None and not math.isclose(base, 10000.0, rel_tol=1e-3)
        hint = (" --rope-pairing interleaved" if turn == "interleaved" else "") + (
            f" --rope-base {ropefreqs.base_words(base)}" if base is not None and other else "")
        yield Trial(replay(b, q=rotate_pairs(b.q, q_pos, 10000.0, turn, sign=table.sign, freqs=table.freqs),
                           k_new=rotate_pairs(b.k_new, k_pos, 10000.0, turn, sign=table.sign, freqs=table.freqs)),
                    f"your code rotates q and k by RoPE ({table.words()}; pairing {pairing}), which the reference "
                    f"was not told of: {{who}} is what the reference computes so rotated; describe it with "
                    f"--rope{hint} (its frequencies are then read from your code)")
    for pairing in ("half", "interleaved"):
        hint = " --rope-pairing interleaved" if pairing == "interleaved" else ""
        yield Trial(replay(b, q=rotate_pairs(b.q, q_pos, 10000.0, pairing),
                           k_new=rotate_pairs(b.k_new, k_pos, 10000.0, pairing)),
                    f"your code rotates q and k by RoPE (base 10000, pairing {PAIRS[pairing].split(',')[0]}), "
                    f"which the reference was not told of: {{who}} is what the reference computes so rotated; "
                    f"describe it with --rope{hint}")
