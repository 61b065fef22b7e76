"""The catalog's scale and softmax mistakes: scores not scaled, scaled twice or by another size, one share of a
split scale left out, a number solved from the scores, the softmax over another axis."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from attnscope.usertrace.rerun import Base, Reproduced, replay

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record
from attnscope.usertrace.trialreads import back_row, has_mask, say_root, user_out
from attnscope.usertrace.trials import Trial


def _d(b: Base) -> tuple[str, int]:
    return ("d_head" if b.kind == "module" else "d_K"), b.d_head


def _ours(b: Base) -> str:
    """The reference's scale in words: its own 1/√d_head, or the user's --scale."""
    told = b.ctx.spec is not None and b.ctx.spec.scale is not None
    origin = b.ctx.spec.scale_from if b.ctx.spec is not None else None
    name, d = _d(b)
    if origin is not None:
        return f"multiplied by {origin}"
    return f"multiplied by --scale {b.scale:g}" if told else f"divided by √{name} = {say_root(d)}"


def _scaled(b: Base, scale: float, how: str, fits: Callable[[Base, Reproduced], bool] | None = None,
            named: bool = False) -> Iterator[Trial]:
    """The reference rerun with the scores scaled by `scale`, said as `how`; `named`: `how` names the size the code
    scaled by, which the words keep where scales.py would only give the ratio."""
    if math.isclose(scale, b.scale, rel_tol=1e-9) or not (math.isfinite(scale / b.scale) and scale > 0):
        return  # the same scale; or a --scale so far out (1e-300) that twice it is 0 in float64: no trial to run
    from attnscope.usertrace.scales import explain_ratio

    ratio = scale / b.scale
    known = explain_ratio("scores", ratio, b.ctx)
    reproduced = f"{{who}} equals the reference's scores {how} instead of {_ours(b)}"
    generic = "a scale differs" in known or (named and "your scores are multiplied by" in known)
    if generic:
        yield Trial(replay(b, scale=scale), reproduced, ratio, fits)
    else:
        yield Trial(replay(b, scale=scale), known, ratio, fits, detail=reproduced)
    if b.table is not None and b.bias is not None:  # a key table's term scaled with q · kᵀ (Shaw's `(qkᵀ + S) · s`)
        from attnscope.usertrace.keytable import term

        with_term = replay(b, scale=scale, bias=b.bias + term(b.q, b.table) * (scale - b.scale))
        yield Trial(with_term, reproduced if generic else known, ratio, fits, detail="" if generic else reproduced)


def trials_scale_none(b: Base) -> Iterator[Trial]:
    """No scale; or, where --scale gives the model's own (T5's 1), the usual 1/√d_head in its place."""
    yield from _scaled(b, 1.0, "not scaled at all")
    yield from _scale_default(b)


def trials_scale_twice(b: Base) -> Iterator[Trial]:
    yield from _scaled(b, b.scale * b.scale, f"scaled twice ({b.scale:.4g} · {b.scale:.4g})", fits=_right_before)
    yield from _query_scaled_first(b)
    name, d = _d(b)
    own = d ** -0.5 if d else None
    if own is not None and b.ctx.spec is not None and b.ctx.spec.scale is not None \
            and not math.isclose(b.scale, own, rel_tol=1e-6):
        # --scale the model's whole scale (Falcon-H1's key_multiplier / √d_head), and the code's own 1/√d_head on the
        # queries before a kernel that scales by it (HF's eager_attention_forward given `scaling`)
        yield from _query_scaled_first(b, own, f"multiplied by 1/√{name} = {own:.4g}")
    if b.bias is not None and isinstance(b.bias, torch.Tensor) and not math.isclose(b.scale, 1.0):
        # the biased scores scaled again, the bias with them (Falcon's `(q · kᵀ + alibi) · s`, then · s once more)
        yield Trial(replay(b, scale=b.scale * b.scale, bias=b.bias * b.scale), "the scores are scaled twice: {who} "
                    f"is the reference's biased scores scaled again, the bias with them ({b.scale:.4g} · "
                    f"{b.scale:.4g}); scale them once")


def _query_scaled_first(b: Base, factor: float | None = None, said: str | None = None) -> Iterator[Trial]:
    """The queries (or what they are projected from, without a bias) scaled by the scale before a kernel or code that
    scales their scores again (fairseq's and OpenNMT's q · d_head^-0.5 handed to nn.MultiheadAttention): every
    query step the reference has, from the projection on, times the scale, and the scores scaled twice. Where the
    queries are normed (a norm takes a scale before it out again), those from the norm on (modded-nanogpt's
    `norm(q) * attn_scale` handed to an attention that scales by it too); and, after a norm, from any later query
    step on (the rotated queries scaled just before the attention: the speedrun's `q * attn_scale` after RoPE)."""
    factor = b.scale if factor is None else factor  # the queries' own (1/√d_head where --scale is the model's)
    if math.isclose(b.scale, 1.0) or math.isclose(factor, 1.0):
        return
    replayed = replay(b, q=b.q * factor)
    queries = [name for name in b.order if name.startswith("Q") and name in b.ref]
    starts = [0]
    if "Q_normed" in queries:
        first = queries.index("Q_normed")
        starts = list(range(first, len(queries)))
    for start in starts:
        scaled = queries[start:]
        steps = dict(replayed)
        for name in scaled:
            steps.setdefault(name, b.ref[name] * factor)
        yield Trial(steps, f"the scores are scaled twice: {{who}} is the reference's queries already scaled "
                    f"({said or _ours(b)}), and the attention then scales their scores again ({factor:.4g} · "
                    f"{b.scale:.4g}); scale q once, or leave the scaling to the attention that does it",
                    fits=_holds_scaled(steps, scaled))


def _holds_scaled(steps: dict[str, torch.Tensor], queries: list[str]) -> Callable[[Base, Reproduced], bool]:
    """Whether the code holds the scaled queries themselves (one of `queries`' steps as `steps` has it)."""
    from attnscope.usertrace.rerun import record_holding

    def held(b: Base, r: Reproduced) -> bool:
        return any(record_holding(b.ctx.records, back_row(b, steps[name]), None, "", b.sums) is not None
                   for name in queries)

    return held


def trials_scale_half(b: Base) -> Iterator[Trial]:
    """One share of a split scale left out: code that scales q and k by √scale each (Whisper's d_head^-0.25 on both)
    and forgets one of them scores by √scale. The share it kept is read from its tensors (q or k times √scale);
    where it holds neither (`scores * d_head ** -0.25`) or both, the scores are said to be scaled by √scale, unless
    a size of the run names that scale (scale.n's words then)."""
    if not 0 < b.scale < 1 or b.q.dim() < 2:
        return
    half = math.sqrt(b.scale)
    kept = _share(b, half)
    name, d = _d(b)
    told = b.ctx.spec is not None and (b.ctx.spec.scale is not None or b.ctx.spec.scale_from is not None)
    if told:
        said, whole = f"√{b.scale:.4g} = {half:.3g}", _ours(b)
    else:
        said, whole = f"{name}^-0.25 = {half:.3g}", f"scaled by {name}^-0.5 = {b.scale:.3g}"
    if kept is None:
        if any(math.isclose(half, 1 / math.sqrt(v), rel_tol=1e-6) or math.isclose(half, 1 / v, rel_tol=1e-6)
               for _, v in _sizes(b)):
            return  # a size of the run names this scale: scale.n's words
        yield Trial(replay(b, scale=half), f"scores scaled by the square root of the scale: {{who}} equals the "
                    f"reference's scores scaled by {said} where the reference's are {whole}, as when a scale split "
                    f"between q and k ({said.split(' = ')[0]} each, Whisper's) is applied to one of them only; scale "
                    f"the scores by {_whole(b, told, name)} in all", half / b.scale)
        return
    from attnscope.usertrace.diagnosis import label_of

    role, record = kept
    other = "keys" if role == "queries" else "queries"
    yield Trial(replay(b, scale=half), f"one share of a split scale is missing: {{who}} equals the reference's "
                f"scores scaled by {said} where the reference's are {whole}: {label_of(record)} takes the {role}' "
                f"share, and the {other}' share of the scale is missing; scale {other[0]} by "
                f"{said.split(' = ')[0]} as well (or the scores by the rest)", half / b.scale)


def _share(b: Base, half: float) -> tuple[str, Record] | None:
    """The queries or the keys the code scaled by `half` (one share of a split scale), and its tensor that holds them
    (the rotated or the unrotated heads times `half`, in any layout); None where it holds both or neither."""
    from attnscope.usertrace.rerun import record_holding

    found = []
    for role, names in (("queries", ("q", "Q")), ("keys", ("k_new", "K"))):
        heads = [getattr(b, names[0]), b.plain(names[1])]
        held = (record_holding(b.ctx.records, back_row(b, t * half), None, "", b.sums) for t in heads if t is not None)
        record = next((r for r in held if r is not None), None)
        if record is not None:
            found.append((role, record))
    return found[0] if len(found) == 1 else None


def _whole(b: Base, told: bool, name: str) -> str:
    return f"{b.scale:.4g}" if told else f"{name}^-0.5 (1/√{name})"


def own_factor(b: Base) -> int | None:
    """The whole factor k ≥ 2 the reference's own scale carries, 1/√(k · d_head) (DeBERTa's scale_factor, 1 + its
    relative terms; a scale read from the module or given with --scale), where it carries one: the sizes a mistake
    puts in d_head's place carry it too (√(k · d_model))."""
    _, d = _d(b)
    if not 0 < b.scale < 1 or d < 1:
        return None
    k = 1 / (b.scale * b.scale * d)
    return round(k) if round(k) >= 2 and math.isclose(k, round(k), rel_tol=1e-6) else None


def _factored(b: Base, size: str, value: int, root: bool) -> tuple[float, str]:
    """The scale with `size` in d_head's place in the reference's own 1/√(k · d_head), and its words."""
    k = own_factor(b)
    assert k is not None
    first, *same = size.split(" = ")  # "n_Q = n_K": one value with two names
    said = f"√({k}·{first}) = {say_root(k * value)}" if root else f"{k}·{first} = {k * value}"
    also = f" (= {' = '.join(same)})" if same else ""
    return (1 / math.sqrt(k * value) if root else 1 / (k * value)), (
        f"divided by {said} (your scale's own factor {k}, with {first}{also} in d_head's place)")


def trials_scale_d(b: Base) -> Iterator[Trial]:
    name, d = _d(b)
    yield from _scaled(b, 1 / d, f"divided by {name} = {d}", fits=lambda b, r: not _right_before(b, r))
    if own_factor(b) is not None:
        scale, said = _factored(b, name, d, False)
        yield from _scaled(b, scale, said, fits=lambda b, r: not _right_before(b, r), named=True)


def _d_model(b: Base) -> int:
    return int(b.sizes.get("d_feat") or b.q.shape[-3] * b.d_head)


def trials_scale_d_model(b: Base) -> Iterator[Trial]:
    if b.kind != "module" or b.q.dim() < 4:
        return
    d_model = _d_model(b)
    yield from _scaled(b, 1 / math.sqrt(d_model), f"divided by √d_model = {say_root(d_model)}")
    if own_factor(b) is not None:  # DeBERTa's √(3 · d_head) with the model's width for the head's
        yield from _scaled(b, *_factored(b, "d_model", d_model, True), named=True)


# What each size the code may scale by is, in words (the reference's own d_head / d_K is scale.d_head's)
SIZE_WORDS = {"n_Q": "the number of queries", "n_K": "the number of keys", "n_head": "the number of heads",
              "n_kv_head": "the number of key/value heads", "n_group": "the query heads per key/value head",
              "n_batch": "the batch size", "d_model": "the model's width", "n_head·d_head": "all heads' width",
              "d_V": "the values' width", "n_cache": "the cached positions"}


def _sizes(b: Base) -> list[tuple[str, int]]:
    """Every size of the run the code could have scaled its scores by, save the reference's own d_head (d_K), each
    value once with all the names it has here ("n_Q = n_K")."""
    found: dict[str, int] = {"n_Q": b.n_Q, "n_K": b.n_K}
    if b.q.dim() >= 3:
        found["n_head"] = int(b.q.shape[-3])
        if b.n_group > 1:
            found["n_kv_head"] = int(b.k_new.shape[-3])
            found["n_group"] = b.n_group
    if b.q.dim() >= 4 or "n_batch" in b.sizes:
        found["n_batch"] = int(b.sizes.get("n_batch") or b.q.shape[0])
    if b.kind == "module" and b.q.dim() >= 3:
        found["d_model"] = int(b.sizes.get("d_feat") or b.q.shape[-3] * b.d_head)
        found["n_head·d_head"] = int(b.q.shape[-3] * b.d_head)
    found["d_V"] = int(b.v_new.shape[-1])
    found["n_cache"] = b.n_cache
    by_value: dict[int, list[str]] = {}
    for name, value in found.items():
        if value > 1 and value != b.d_head:
            by_value.setdefault(value, []).append(name)
    return [(" = ".join(names), value) for value, names in by_value.items()]


def _size_words(names: str, value: int, root: bool) -> str:
    said = f"{' = '.join(f'√{n}' for n in names.split(' = '))} = {say_root(value)}" if root else f"{names} = {value}"
    what = " and ".join(SIZE_WORDS[n] for n in names.split(" = ") if n in SIZE_WORDS)
    return f"{said}, {what}," if what else said


def _parts(b: Base) -> list[tuple[str, int]]:
    """The parts of a latent attention's head (its Q_nope and Q_pe: d_nope and d_rope, whose sum is d_K), where the
    reference has them; none otherwise."""
    found = [(name, int(b.ref[step].shape[-1])) for name, step in (("d_nope", "Q_nope"), ("d_rope", "Q_pe"))
             if step in b.ref]
    return found if len(found) == 2 and sum(v for _, v in found) == b.d_head else []


PART_WORDS = {"d_nope": "the heads' no-RoPE part alone (qk_nope_head_dim)",
              "d_rope": "the heads' rotary part alone (qk_rope_head_dim)"}


def trials_scale_n(b: Base) -> Iterator[Trial]:
    """The scores divided by another size of the run than d_head (n_Q, n_K, n_head, d_model, d_V, ...), whole or
    its root, in its place or on top of the reference's own scale; in latent attention, by the root of one part of
    the head in place of √d_K (in a scale the module declares around it too: DeepSeek's mscale²)."""
    for name, value in _parts(b):
        yield from _scaled(b, b.scale * math.sqrt(b.d_head / value), f"divided by √{name} = {say_root(value)}, "
                           f"{PART_WORDS[name]}, where √d_K = √(d_nope + d_rope) belongs", named=True)
    for names, value in _sizes(b):
        for root in (True, False):
            size = math.sqrt(value) if root else float(value)
            said = _size_words(names, value, root)
            yield from _scaled(b, 1 / size, f"divided by {said}", named=True)
            yield from _scaled(b, b.scale / size, f"divided by {said} on top of the reference's scale", named=True)
            if own_factor(b) is not None:
                yield from _scaled(b, *_factored(b, names, value, root), named=True)


def trials_scale_other(b: Base) -> Iterator[Trial]:
    """The scale the code used, solved from its tensors that are the reference's scores times a constant, where no
    size of the run names it: rerun with that scale."""
    from attnscope.usertrace.align import VERY_NEGATIVE, layouts

    scores = user_out(b, "scores") if "scores" in b.ref else None
    if scores is None:
        return
    tried: list[float] = []
    for record in b.ctx.records:
        user = record.tensor
        if not user.is_floating_point() or user.numel() != scores.numel() or user.dim() < 2:
            continue
        for layout in layouts(tuple(scores.shape), tuple(user.shape))[:4]:
            expected = layout.apply(scores, tuple(user.shape)).double()
            mine = user.double()
            kept = torch.isfinite(mine) & (mine > VERY_NEGATIVE) & torch.isfinite(expected)
            e, u = expected[kept], mine[kept]
            if e.numel() < 2 or float((e * e).sum()) == 0.0:
                continue
            ratio = float((u * e).sum() / (e * e).sum())
            if not math.isfinite(ratio) or ratio <= 0 or math.isclose(ratio, 1.0, rel_tol=1e-4):
                continue
            if float((u - ratio * e).abs().max()) > 1e-4 * max(float(u.abs().max()), 1e-12):
                continue
            scale = float(f"{b.scale * ratio:.6g}")
            if any(math.isclose(scale, t, rel_tol=1e-5) for t in tried) or _named_scale(b, scale):
                continue
            tried.append(scale)
            split = _split_width(b, scale)
            if split is not None:  # Nemotron-H's `(hidden_size // num_heads) ** -0.5` beside its own head_dim
                yield Trial(replay(b, scale=scale), f"{{who}} equals the reference's scores multiplied by {scale:.6g} "
                            f"= 1/√(d_feat / n_head) = 1/√{split}, instead of {_ours(b)}: the head width d_feat / "
                            f"n_head would be, where your heads are {_d(b)[1]} wide (a head_dim set apart from "
                            "hidden_size / num_heads); scale by the heads' own width", ratio)
                continue
            yield Trial(replay(b, scale=scale), f"{{who}} equals the reference's scores multiplied by {scale:.6g} "
                        f"instead of {_ours(b)}, and {scale:.6g} is no size of the run (nor its root): if it is your "
                        f"model's scale, pass --scale {scale:.6g}, else fix the scale", ratio)


def _split_width(b: Base, scale: float) -> int | None:
    """d_feat / n_head where `scale` is 1/√ of it and it is not the heads' own width d_head (a module whose head_dim
    is set apart from hidden_size / num_heads); None otherwise."""
    if b.kind != "module" or b.q.dim() < 4:
        return None
    d_model, n_head, d = _d_model(b), int(b.q.shape[-3]), _d(b)[1]
    if d_model % n_head or d_model // n_head == d:
        return None
    width = d_model // n_head
    return width if math.isclose(scale, 1 / math.sqrt(width), rel_tol=1e-4) else None


def _named_scale(b: Base, scale: float) -> bool:
    """Whether another scale entry tries `scale` already (1, √d_head's kin, a size of the run)."""
    _, d = _d(b)
    known = [1.0, b.scale * b.scale, 1 / d, math.sqrt(d), 1 / math.sqrt(d), math.sqrt(b.scale)]
    for _, value in _sizes(b):
        known += [1 / math.sqrt(value), 1 / value, b.scale / math.sqrt(value), b.scale / value]
    if b.kind == "module" and b.q.dim() >= 4:
        known.append(1 / math.sqrt(_d_model(b)))
    k = own_factor(b)
    if k is not None:  # the sizes with the scale's own factor (scale.d_model's, scale.n's and scale.d_head's)
        values = [v for _, v in _sizes(b)] + [d] + ([_d_model(b)] if b.kind == "module" and b.q.dim() >= 4 else [])
        known += [1 / math.sqrt(k * v) for v in values] + [1 / (k * v) for v in values]
    return any(math.isclose(scale, k, rel_tol=1e-5) for k in known)


def trials_scale_multiplied(b: Base) -> Iterator[Trial]:
    name, d = _d(b)
    yield from _scaled(b, math.sqrt(d), f"multiplied by √{name} = {say_root(d)}")


def _scale_default(b: Base) -> Iterator[Trial]:
    """1/√d_head where --scale says the model's scale is another (T5's 1, Gemma 2's query_pre_attn_scalar)."""
    if b.ctx.spec is None or b.ctx.spec.scale is None:
        return
    name, d = _d(b)
    yield from _scaled(b, 1 / math.sqrt(d), f"divided by √{name} = {say_root(d)}")


def _right_before(b: Base, r: Reproduced) -> bool:
    """The user's code held the right scores before it scaled them again, or scales by the reference's own scale
    twice (scales_twice): where d_head is a square, twice 1/√d_head is 1/d_head, and the code says which it did."""
    from attnscope.usertrace.rerun import record_holding

    return "scores" in b.ref and record_holding(b.ctx.records, user_out(b, "scores"), None, "", b.sums) is not None \
        or scales_twice(b)


SCALINGS = {"mul": 1, "__mul__": 1, "__rmul__": 1, "multiply": 1, "mul_": 1, "__imul__": 1,
            "div": -1, "__truediv__": -1, "divide": -1, "div_": -1, "__itruediv__": -1}


def scales_twice(b: Base) -> bool:
    """Whether the code multiplies by the reference's scale (or divides by its inverse) in two ops before its
    softmax, each by a number written in the code (Hiera's `(query * self.scale) @ key.mT` then `* self.scale`
    again, on scores its windows gather, where no tensor of the code holds the reference's scores whole)."""
    from attnscope.usertrace.record import SOFTMAXES

    softmax = next((r.index for r in b.ctx.records if r.func.split(".")[-1] in SOFTMAXES), None)
    if softmax is None or not b.scale:
        return False
    count = 0
    for r in b.ctx.records[:softmax]:
        power = SCALINGS.get(r.func)
        if power is None:
            continue
        for kind, value in r.args:
            try:
                number = float(value) if kind == "text" else None
            except ValueError:
                number = None
            if number and math.isclose(number ** power, b.scale, rel_tol=1e-5):
                count += 1
                break
    return count >= 2


def trials_softmax_axis(b: Base) -> Iterator[Trial]:
    from attnscope.usertrace.scoreaxes import keys_last

    dims = b.dims["attention"] if not b.col else (*b.dims["attention"][:-2], "n_Q", "n_K")
    # the code's own scores' layout, where the data flow says it (square scores Qᵀ K in the column form), else the
    # layout's
    keys_first = b.col if not b.ctx.keys else not keys_last(b.ctx.keys)
    own = code_masked(b) if has_mask(b) else code_shifted(b)
    for axis in range(-2, -len(dims) - 1, -1):
        where = dims[axis]
        said = f"dim={axis}" if not keys_first else f"dim={-3 - axis if axis > -3 else axis}"
        keys = "dim=-2 of scores [.., n_K, n_Q]" if keys_first else "dim=-1 of scores [.., n_Q, n_K]"
        words = (f"the softmax ran over {where}, not over n_K ({said} where the keys' axis is {keys}): {{who}} "
                 f"equals the reference's attention with the softmax over {where}, so it sums to 1 over {where} "
                 "rather than over the keys")
        # the code's own zeroing of the masked weights after its softmax kept (ESPnet's masked_fill(mask, 0.0))
        for zeroed in (False, True) if zeroes_after(b) else (False,):
            yield Trial(replay(b, softmax_dim=axis, zeroed=zeroed), words)
            if has_mask(b):  # masked with a large finite number (-1e9): a column masked whole is uniform, not NaN
                yield Trial(replay(b, softmax_dim=axis, mask="finite", zeroed=zeroed), words)
                # or one added to the scores (BERT's −10000): the column keeps its scores, normalized over the queries
                yield Trial(replay(b, softmax_dim=axis, mask="added", zeroed=zeroed), words)
                if own is not None:  # or its own finite numbers there: two biases added, −20000 where both mask
                    yield Trial(replay(b, softmax_dim=axis, mask="own", masked_as=own, zeroed=zeroed), words)
            elif own is not None:  # the scores as its softmax takes them, each query's max taken out (CogView's)
                yield Trial(replay(b, softmax_dim=axis, mask="own", masked_as=own, zeroed=zeroed), words)
    from attnscope.usertrace.piecetrials import softmax_in_pieces

    yield from softmax_in_pieces(b)  # scores in groups' pieces (divided attention): over each piece's queries


def code_masked(b: Base) -> torch.Tensor | None:
    """What the code's softmax takes, in the reference's row form, where it is the reference's masked scores with
    the masked cells finite (old GPT-2's causal −10000 and padding −10000 added, −20000 where both mask), or up to a
    constant per query row (torchaudio's wav2vec2 takes each row's max out first): a softmax over another axis of
    those is not one of the reference's masked scores; None elsewhere."""
    from attnscope.usertrace.align import best_equal, row_spread, tolerance

    if b.allowed is None:
        return None
    wanted = user_out(b, "masked_scores")
    kept = torch.where(b.allowed, b.ref["masked_scores"], 0.0)
    for theirs, dtype in _softmax_inputs(b, wanted):
        spread = row_spread(theirs, b.ref["masked_scores"], -1)
        if spread is not None and spread <= tolerance(kept, dtype) and _finite_masked(theirs, b.allowed):
            return theirs
    held = best_equal(b.ctx.records, wanted, None)  # else the masked scores the code holds
    if held is None:
        return None
    own = back_row(b, held.layout.undo(held.record.tensor, tuple(wanted.shape)).double())
    if own.shape != b.allowed.shape or not _finite_masked(own, b.allowed):
        return None
    return own


def _softmax_inputs(b: Base, wanted: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.dtype]]:
    """What each of the code's softmaxes takes, laid out as `wanted` (a step of the scores in the code's layout),
    in the reference's row form, float64, with its own dtype."""
    for fed in (r for r in b.ctx.records if r.func in ("softmax", "_softmax") and r.args and r.args[0][0] == "rec"):
        given = b.ctx.records[fed.args[0][1]].tensor  # what the softmax took, where laid out as the scores are
        if given.dim() == 3 and len(wanted.shape) == 4 and given.numel() == wanted.numel() \
                and tuple(given.shape[-2:]) == tuple(wanted.shape[-2:]):  # heads in the batch (CLIP's, BART's bmm)
            given = given.reshape(wanted.shape)
        if tuple(given.shape) != tuple(wanted.shape) or not given.is_floating_point():
            continue
        yield back_row(b, given.double()), given.dtype


def code_shifted(b: Base) -> torch.Tensor | None:
    """What the code's softmax takes, in the reference's row form, where it is the reference's scores (biased, where
    the reference adds a bias) up to a constant per query row and not equal to them: each row's max taken out by
    hand before the softmax (CogView's PB-relax in LayoutLMv3, `(s / α − max(s / α)) · α`), which a softmax over the
    keys ignores and one over another axis does not. None elsewhere."""
    from attnscope.usertrace.align import row_spread, tolerance

    step = next((s for s in ("biased_scores", "scores") if s in b.ref), None)
    if step is None:
        return None
    wanted, reference = user_out(b, step), b.ref[step]
    for theirs, dtype in _softmax_inputs(b, wanted):
        spread = row_spread(theirs, reference, -1)
        tol = tolerance(reference, dtype)
        if spread is not None and spread <= tol and float((theirs - reference.double()).abs().max()) > tol:
            return theirs
    return None


def _finite_masked(scores: torch.Tensor, allowed: torch.Tensor) -> bool:
    """Whether the code's masked scores hold finite numbers in the masked cells, some or all of them (CLIP's causal
    and padding masks, finfo.min each, added: −inf where both mask, finfo.min where one does), and nothing else
    there that is no number: every allowed cell finite."""
    if scores.shape != allowed.shape:
        return bool(torch.isfinite(scores).all())
    masked = scores[~allowed]
    return bool(torch.isfinite(scores[allowed]).all()) and not bool(masked.isnan().any()) \
        and bool(torch.isfinite(masked).any() or masked.numel() == 0)


def zeroes_after(b: Base) -> bool:
    """Whether the code sets some of its weights to 0 after its softmax itself, with a mask given
    (masking.after_softmax: ESPnet's and WeNet's `masked_fill(mask, 0.0)` on the softmax's output): the reruns of a
    mistake before it keep that zeroing."""
    from attnscope.usertrace.masking import after_softmax

    return has_mask(b) and b.allowed is not None and after_softmax(b.ctx.records) is not None
