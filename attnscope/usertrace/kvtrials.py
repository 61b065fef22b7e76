"""The catalog's key and value mistakes: K and V swapped (before or after a norm, joined with a cache), the values
taken from the keys (the keys taken from the values: keytrials.py), key/value heads tiled instead of interleaved or
grouped in the wrong order."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from attnscope.usertrace.rerun import Base, record_holding, replay
from attnscope.usertrace.roperead import ReadRope, read_rope, rejoined, rope_turn
from attnscope.usertrace.trials import Trial


def trials_swapped(b: Base) -> Iterator[Trial]:
    if b.k_new.shape != b.v_new.shape:
        return
    words = ("keys and values swapped: {who} is what the reference computes with K in V's place and V in K's "
             "(the scores read the values, the pattern multiplies the keys)")
    rope = read_rope(b)
    if b.raw_keys is not None and rope is not None:  # the code joins its cache before RoPE, then rotates the keys
        yield from _joined_swaps(b, rope, words)
        return
    if not torch.equal(b.k_new, b.v_new):  # swapping one tensor with itself changes nothing: no mistake it shows
        # (the values pooled from the keys' projection are the pooled keys: the swap before the pooling says it)
        steps = replay(b, k_new=b.v_new, v_new=b.k_new)
        _feats_swapped(b, steps)
        yield Trial(steps, words)
        gain = _key_gain(b)
        if gain is not None:  # the keys' own factor goes with them into the values, off the scores
            steps = replay(b, k_new=b.v_new, v_new=b.k_new * gain, scale=b.scale / gain)
            _feats_swapped(b, steps)
            yield Trial(steps, f"{words}, the factor your code gives its keys ({gain:.4g}, a share of the scale "
                        "the reference puts on the scores) going with them into the values")
    if "K_pooled" in b.ref and "V_pooled" in b.ref and b.ref["V_feat"].shape == b.ref["K_feat"].shape \
            and _feeds_keys(b, b.ref["V_feat"]):
        # swapped before the code pools them (pooled.py): the pooled ones the reference reads are the code's own;
        # the code's keys are then made from the values' projection (a value part cut and never read, or read and
        # thrown away, beside the keys pooled twice is no swap)
        steps = replay(b)
        steps["K_feat"], steps["V_feat"] = b.ref["V_feat"], b.ref["K_feat"]
        yield Trial(steps, words + ", before your code pools them", fits=lambda _, r: r.held >= 2)  # both held
    if b.cache is not None:  # swapped after the cache was joined: the cached keys and values swapped too
        yield Trial(replay(b, k_new=b.v_new, v_new=b.k_new, swap_cache=True), words + ", after the cache was joined "
                    "(the cached ones swapped as well)")
    plain_k = b.plain("K")
    if rope is not None and plain_k is not None:
        rotated_v = rope_turn(rope)(b.v_new, rope.k_pos)  # the reference's own turn: its fraction, sign, table
        steps = replay(b, k_new=rotated_v, v_new=plain_k)
        _feats_swapped(b, steps)
        yield Trial(steps, words + ", each projected by the other's weights and then rotated as the keys are")
    yield from _swapped_before_norm(b, rope, words)
    yield from _swapped_before_proj_norm(b, rope, words)
    yield from _swapped_by_flow(b, rope, words)


def _key_gain(b: Base) -> float | None:
    """The number the code multiplies its keys by itself where the reference's scale holds it (Falcon-H1's
    `key_multiplier` beside `--scale`, which the line-up reads as a share of the scale on K_rot): the code's tensor
    equal to the reference's keys (rotated, or as split) times a number other than 1 (align.best_scaled); None where
    the code holds none."""
    from attnscope.usertrace.align import best_scaled

    for name in dict.fromkeys((b.names["k"], "K_split")):
        if name in b.ref:
            found = best_scaled(b.ctx.records, b.ref[name])
            if found is not None and found.factor is not None and math.isfinite(found.factor) \
                    and found.factor != 0.0 and abs(found.factor - 1.0) > 1e-6:
                return float(found.factor)
    return None


def _feeds_keys(b: Base, step: torch.Tensor) -> bool:
    """Whether a tensor of the code's holding `step` is one the scores' keys are made from."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.flow import operands

    held, found = record_holding(b.ctx.records, step, None, "", b.sums), operands(b.ctx.records)
    return held is not None and found is not None and held.index in ancestors(b.ctx.records[found[1]], b.ctx.records)


def _swapped_by_flow(b: Base, rope: ReadRope | None, words: str) -> Iterator[Trial]:
    """kv.swapped where the reference read its K and V weights from the data flow, the scores' right operand made by
    the projection that should make the values (`sdpa(q, v, k)` after RoPE, no names holding the weights): the
    code's keys are the reference's K as projected, never rotated or normed, and its values the reference's V
    normed and rotated as the keys are (in the order it does those), the heads grouped as the reference groups
    them."""
    from attnscope.usertrace.fusedsplit import refit_norm
    from attnscope.usertrace.reference import late_norm

    plain = b.ref.get("K_split")
    if plain is None or plain.shape != b.v_new.shape or b.raw_keys is not None or b.names.get("v") != "V_split":
        return
    late = rope is not None and late_norm(b.order, "K_normed")
    values, norm = b.v_new, None
    if "K_normed" in b.ref:
        norm = refit_norm(b.ref["K_rot"] if late else plain, b.ref["K_normed"])
        if norm is None:
            return
        values = norm(rope_turn(rope)(values, rope.k_pos)) if late and rope is not None else norm(values)
    if rope is not None and not late:
        values = rope_turn(rope)(values, rope.k_pos)
    if values is b.v_new:  # neither rotated nor normed: the plain swap already
        return
    steps = replay(b, k_new=plain, v_new=values)
    for name in ("K_normed", "K_rot"):
        if name in b.ref and name != b.names["k"]:
            steps[name] = plain
    done = [n for n, held in (("rotated", rope is not None), ("normed", "K_normed" in b.ref)) if held]
    never = "neither " + " nor ".join(done) if len(done) > 1 else f"never {done[0]}"
    yield Trial(steps, f"{words}, after the keys were {' and '.join(done)}: the scores read a projection {never}, "
                f"and the pattern multiplies the one {' and '.join(done)} as keys are")
    if norm is not None and rope is not None and not late:  # swapped between the norm and RoPE
        steps = replay(b, k_new=rope_turn(rope)(plain, rope.k_pos), v_new=norm(b.v_new).to(b.v_new.dtype))
        if "K_normed" != b.names["k"]:
            steps["K_normed"] = plain
        yield Trial(steps, f"{words}, after the keys were normed and before RoPE: the scores read a projection "
                    "rotated and never normed, and the pattern multiplies the one normed as keys are")


def _feats_swapped(b: Base, steps: dict[str, torch.Tensor]) -> None:
    """`steps` with K_feat and V_feat swapped, where the reference has both of one shape: the code's keys are the
    value projection's output from the first step on (`k, v = self.v_proj(x), self.k_proj(x)`)."""
    if "V_feat" in b.ref and "K_feat" in b.ref and b.ref["V_feat"].shape == b.ref["K_feat"].shape:
        steps["K_feat"], steps["V_feat"] = b.ref["V_feat"], b.ref["K_feat"]


def _swapped_before_norm(b: Base, rope: ReadRope | None, words: str) -> Iterator[Trial]:
    """kv.swapped before a qk-norm (Qwen3's `k_norm(v_proj(x))`, `v = k_proj(x)`): the keys' norm, refit from the
    reference's own keys before and after it, applied to the values, then rotated where the reference rotates; the
    values the keys as projected, unnormed."""
    from attnscope.usertrace.fusedsplit import refit_norm
    from attnscope.usertrace.reference import late_norm

    unnormed, normed = b.ref.get("K_split"), b.ref.get("K_normed")
    if unnormed is None or normed is None or unnormed.shape != b.v_new.shape or b.raw_keys is not None:
        return
    late = rope is not None and late_norm(b.order, "K_normed")  # normed after the rotation (nGPT's gains)
    norm = refit_norm(b.ref["K_rot"] if late else unnormed, normed)
    if norm is None or rope is None and late:
        return
    if late and rope is not None:
        turned = rope_turn(rope)(b.v_new, rope.k_pos)
        rotated = keys = norm(turned)
    else:
        keys = norm(b.v_new)
        rotated = rope_turn(rope)(keys, rope.k_pos) if rope is not None else keys
    steps = replay(b, k_new=rotated, v_new=unnormed)
    steps["K_split"], steps["K_normed"] = b.v_new, keys
    if late:
        steps["K_rot"] = turned
    _feats_swapped(b, steps)
    then = "rotated and normed" if late else "normed and rotated" if rope is not None else "normed"
    yield Trial(steps, f"{words}, each projected by the other's weights before the keys' norm (the values then {then} "
                "as the keys are)")


def _swapped_before_proj_norm(b: Base, rope: ReadRope | None, words: str) -> Iterator[Trial]:
    """kv.swapped before a qk-norm over the whole projection (OLMo 2's `k_norm(v_proj(x))`, `v = k_proj(x)`): the
    keys' norm, refit from the reference's own projection before and after it, applied to the value projection's
    output, then split and rotated as the keys are; the values the key projection's output, unnormed, split."""
    from attnscope.usertrace.fusedsplit import refit_norm

    feat, normed, split = b.ref.get("K_feat"), b.ref.get("K_normed"), b.ref.get("K_split")
    values = b.ref.get("V_feat")
    if feat is None or normed is None or split is None or values is None or b.raw_keys is not None \
            or feat.dim() != 3 or normed.shape != feat.shape or values.shape != feat.shape or split.dim() != 4 \
            or split.shape != b.v_new.shape:
        return
    norm = refit_norm(feat[:, None], normed[:, None])  # [n_batch, 1, n, width]: one gain per coordinate
    if norm is None:
        return
    heads, d = int(split.shape[1]), int(split.shape[-1])

    def by_heads(x: torch.Tensor) -> torch.Tensor:  # [n_batch, n, heads·d] -> [n_batch, heads, n, d]
        return x.unflatten(-1, (heads, d)).transpose(1, 2)

    keys_normed = norm(values[:, None])[:, 0].to(values.dtype)
    keys = by_heads(keys_normed)
    rotated = rope_turn(rope)(keys, rope.k_pos) if rope is not None else keys
    steps = replay(b, k_new=rotated, v_new=by_heads(feat))
    steps["K_normed"], steps["K_split"], steps["V_split"] = keys_normed, keys, by_heads(feat)
    _feats_swapped(b, steps)
    then = "normed over the whole projection, split and rotated" if rope is not None else \
        "normed over the whole projection and split"
    yield Trial(steps, f"{words}, each projected by the other's weights before the keys' norm (the values then {then} "
                "as the keys are)")


def _joined_swaps(b: Base, rope: ReadRope, words: str) -> Iterator[Trial]:
    """kv.swapped in code that joins its cache before RoPE: swapped before the join (the values rotated as keys), once
    joined (the cached ones swapped as well), before the rotation or after it."""
    plain_k = b.plain("K")
    start = int(rope.k_pos[0]) - b.n_cache
    turn = rope_turn(rope)
    steps = rejoined(b, b.q, turn, keys=b.v_new, values=plain_k, start=start)
    _feats_swapped(b, steps)
    yield Trial(steps, words + ", before the cache was joined (the values then rotated as the keys are)")
    for when, said in (("join", "before the rotation, so the values are rotated as the keys"),
                       ("turned", "after the rotation")):
        yield Trial(rejoined(b, b.q, turn, start=start, swapped=when), f"{words}, after the cache was joined (the "
                    f"cached ones swapped as well) and {said}")


def trials_values_from_keys(b: Base) -> Iterator[Trial]:
    if b.k_new.shape[:-1] != b.v_new.shape[:-1]:
        return
    words = ("the values are the keys: {who} is what the reference computes with V = K{how}, as though the value "
             "projection were the key one (`v = k`, or `self.k_proj(x)` twice)")
    yield Trial(_keys_projected(b, replay(b, v_new=b.k_new)), words.replace("{how}", ""))
    if "V_pooled" in b.ref:  # values pooled from the keys' projection (pooled.py): the pooled values the reference
        # attends over are the code's own, so V_feat alone is the keys' projection
        yield Trial(_keys_projected(b, replay(b)), words.replace("{how}", " before your code pools them"))
    # the keys as code that splits the scale between q and k holds them (Whisper's k · d_head^-0.25)
    yield Trial(replay(b, v_new=b.k_new * math.sqrt(b.scale)), words.replace(
        "{how}", f" scaled as your keys are, K · √scale = K · {math.sqrt(b.scale):.4g} (the scale split between q "
        "and k)"))
    plain_k = b.plain("K")
    if read_rope(b) is not None and plain_k is not None:
        yield Trial(_keys_projected(b, replay(b, v_new=plain_k)), words.replace("{how}", " before RoPE"))
    unnormed = b.ref.get("K_split")  # the keys as projected, before a qk-norm (Cohere's v from k_proj, unnormed)
    feat, normed = b.ref.get("K_feat"), b.ref.get("K_normed")
    if feat is not None and normed is not None and normed.shape == feat.shape:  # OLMo 2's norm over the whole
        # projection, before the split: K_split is split from the normed keys; the projection's, split as V is
        unnormed = heads_of(feat, b.v_new, b.strided)
    if normed is not None and unnormed is not None and unnormed.shape == b.v_new.shape:
        yield Trial(_keys_projected(b, replay(b, v_new=unnormed)), words.replace(
            "{how}", " as projected, before the qk-norm"))
    yield from _value_input_by_keys(b)


def _value_input_by_keys(b: Base) -> Iterator[Trial]:
    """The value input through the key projection (DistilBERT's `v = shape(self.k_lin(value))`): where the code
    takes its keys and values from inputs of their own (`forward(query, key, value)`), V = K never holds, yet its
    values are value · W_kᵀ + b_k, split into heads as the reference splits V_feat."""
    made = by_other_weights(b, "k", 2)
    if made is None or b.names.get("v") != "V_split" or "V_pooled" in b.ref:
        return
    feat, name = made
    heads = heads_of(feat, b.v_new, b.strided)
    if heads is None:
        return
    steps = replay(b, v_new=heads)
    steps["V_feat"] = feat
    yield Trial(steps, f"the values made by the key projection: {{who}} is what the reference computes with the "
                f"value input through {name} (V = value · W_kᵀ + b_k, `self.k_proj(value)`), the value projection "
                "left unused; your keys and values come from inputs of their own, so V = K is not what it gives")


def by_other_weights(b: Base, role: str, index: int) -> tuple[torch.Tensor, str] | None:
    """The reference's input `index` (0 Q, 1 K, 2 V, as it reads them) through the projection of `role` (its
    weight and bias, float64), and that projection's name; None where that input is the one `role` reads already
    (self-attention: one x), or no such projection of that width is held."""
    projections, inputs = b.ctx.projections, b.ctx.inputs
    if projections is None or inputs is None or role not in projections.linears:
        return None
    xs: tuple[torch.Tensor, ...] = inputs.qkv()
    if inputs.layout == "col":  # [n_batch, d, n] as the code takes them -> the reference's rows [n_batch, n, d]
        xs = tuple(t.transpose(-1, -2) if t.dim() == 3 else t for t in xs)
    # a role's input side of the code's own (qkinput.py: DETR's `q = k = tgt + query_pos` beside the values' tgt)
    xs = tuple((inputs.own or {}).get(r, t) for r, t in zip("QKV", xs, strict=True))
    own = xs[1 if role == "k" else 2 if role == "v" else 0]
    x = xs[index]
    if x.dim() != 3 or x is own or (x.shape == own.shape and torch.equal(x, own)):
        return None
    name, linear = projections.linears[role]
    weight, bias = getattr(linear, "weight", None), getattr(linear, "bias", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        return None
    bias = bias.detach().double() if isinstance(bias, torch.Tensor) else None
    return torch.nn.functional.linear(x.double(), weight.detach().double(), bias), name


def heads_of(feat: torch.Tensor, like: torch.Tensor, strided: bool = False) -> torch.Tensor | None:
    """`feat` [n_batch, n, heads·d] split as `like` [n_batch, heads, n, d]; None where the sizes differ. `strided`:
    each head every heads-th feature, as the reference splits under stridedheads.py's reading."""
    if like.dim() != 4 or feat.dim() != 3 or feat.shape[-1] != like.shape[1] * like.shape[-1] \
            or feat.shape[:2] != (like.shape[0], like.shape[2]):
        return None
    if strided:  # [n_batch, n, d, heads] -> [n_batch, heads, n, d]
        return feat.unflatten(-1, (int(like.shape[-1]), int(like.shape[1]))).permute(0, 3, 1, 2)
    return feat.unflatten(-1, (int(like.shape[1]), int(like.shape[-1]))).transpose(1, 2)


def _keys_projected(b: Base, steps: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`steps` with V_feat the keys' projection, K_feat (`v = self.k_proj(x)`: the values' projection is the keys'
    already, so the code's values equal K_feat from the first step on, whatever is done to the keys after)."""
    if "V_feat" in b.ref and "K_feat" in b.ref and b.ref["V_feat"].shape == b.ref["K_feat"].shape:
        steps["V_feat"] = b.ref["K_feat"]
    return steps


def trials_tiled(b: Base, repeated: bool) -> Iterator[Trial]:
    """gqa.tiled (`repeated`) or gqa.group_order: the same rerun, the heads tiled; which one the code's data flow
    says (kvrepeat.py): the keys or values widened to the query heads by an op of the code's (the layout is that
    op's, gqa.tiled), or never (the queries grouped against unrepeated keys, gqa.group_order)."""
    from attnscope.usertrace.kvrepeat import kv_repeat, tiled_words

    if b.n_group < 2:
        return
    n_kv = b.k_new.shape[-3]
    rep = kv_repeat(b)
    if repeated:
        words = tiled_words(b, rep)
    else:
        words = (f"query heads grouped in the wrong order: {{who}} is what the reference computes where query head h "
                 f"reads key/value head h % {n_kv}, as a grouped einsum over q viewed as [n_batch, {b.n_group}, "
                 f"{n_kv}, ...] (n_group before n_kv_head) computes; query heads h·{b.n_group} to "
                 f"h·{b.n_group} + {b.n_group - 1} share key/value head h, so view q as [n_batch, n_kv_head, n_group, "
                 "n_Q, d_head] (transformers' repeat_kv order)")
    yield Trial(replay(b, repeat="tile"), words, fits=lambda b, r: (rep is not None) == repeated)
    if not repeated:  # the grouped result merged back in its own order, [.., n_kv_head, n_group, ..]: the output
        # projection then reads query head g·n_kv_head + kv at kv·n_group + g, as though q's heads were reordered
        order = torch.arange(b.q.shape[-3]).view(b.n_group, n_kv).t().reshape(-1)
        yield Trial(replay(b, q=b.q.index_select(-3, order)), words, fits=lambda b, r: rep is None)
