"""The catalog of mistakes `trace` names by experiment: each entry a named transformation of the reference's run
(rerun.replay with one change) and the words that say what the rerun reproduced.

After the first divergence, diagnose.py runs the reference again with each entry applied; an entry names the
cause only where its run gives the user's own tensors back to tolerance (rerun.reproduces: the user's output, and
the tensor where the line-up diverged). Where two entries compute the same numbers (scores multiplied by the mask
or filled with 0; the heads tiled or a grouped einsum in the wrong order), the user's own op decides which words.
The catalog in words, with an example of each message, is docs/trace.md's "The catalog of mistakes".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from attnscope.usertrace.rerun import Base, Reproduced, replay

if TYPE_CHECKING:
    from attnscope.spec import WindowSide
    from attnscope.usertrace.record import Record

SAYS_RERUN = "the reference run again with this mistake gives back {gives} to tolerance"


@dataclass
class Trial:
    """One run of an entry: the replayed steps, the words (`{who}`: the user's tensor that shows it), the ratio
    of a scale, and what the user's own op must be for these words (None: any)."""

    steps: dict[str, torch.Tensor]
    words: str
    ratio: float | None = None
    fits: Callable[[Base, Reproduced], bool] | None = None
    tol: str = ""
    detail: str = ""  # what the rerun changed, where the words name the mistake otherwise (a scale's ratio)


@dataclass(frozen=True)
class Experiment:
    name: str  # stable, in --json's first_divergence.experiment: "scale.d_model"
    group: str
    mistake: str  # one line for the docs
    trials: Callable[[Base], Iterator[Trial]] = field(compare=False)

    def can_change(self, b: Base, step: str) -> bool:
        """Whether the mistake can change `step`: it is not before the first step the mistake's group changes."""
        starts = JOINED_FIRST.get(self.group, ()) if b.raw_keys is not None else ()
        first = [b.order.index(n) for n in (*FIRST.get(self.group, ()), *starts) if n in b.order]
        return not first or b.order.index(step) >= min(first)


# The steps a group's mistakes change first (the earliest the reference holds); one before them they leave alone.
# (the scale's: the queries too, scaled before a kernel that scales again)
FIRST = {"scale": ("scores", "Q_feat", "Q_split", "Q_rot", "Q"),
         "softcap": ("scores", "capped_scores", "biased_scores", "masked_scores", "attention"),
         "softmax": ("attention",), "mask": ("masked_scores",),
         "keys and values": ("K_feat", "V_feat", "K_rot", "K_split", "K", "V_split", "V", "scores"),
         "cache": ("K_cat", "V_cat"),
         "grouped-query": ("K_rep", "V_rep", "scores"), "RoPE": ("Q_split", "K_split", "Q_rot", "K_rot", "scores"),
         "ALiBi": ("biased_scores",), "T5 bias": ("biased_scores",), "precision": ("scores",),
         "dropout": ("attention",), "heads": ("Q_split", "K_split", "V_split", "x_rsh2", "Q_feat", "K_feat", "V_feat")}
# (a fused projection's heads split wrongly: the first tensor of the code's that holds Q_feat apart is the split one,
# usertrace/fusedsplit.py)
# Where the code joins its cache before RoPE (rerun.Base.raw_keys), the join's mistakes change the rotated keys too
JOINED_FIRST = {"cache": ("K_rot",)}


# --- scale ----------------------------------------------------------------------------------------------------


def _d(b: Base) -> tuple[str, int]:
    return ("d_head" if b.kind == "module" else "d_K"), b.d_head


def _ours(b: Base) -> str:
    """The reference's scale in words: its own 1/√d_head, or the user's --scale."""
    told = b.ctx.spec is not None and b.ctx.spec.scale is not None
    origin = b.ctx.spec.scale_from if b.ctx.spec is not None else None
    name, d = _d(b)
    if origin is not None:
        return f"multiplied by {origin}"
    return f"multiplied by --scale {b.scale:g}" if told else f"divided by √{name} = {_root(d)}"


def _scaled(b: Base, scale: float, how: str, fits: Callable[[Base, Reproduced], bool] | None = None,
            named: bool = False) -> Iterator[Trial]:
    """The reference rerun with the scores scaled by `scale`, said as `how`; `named`: `how` names the size the code
    scaled by, which the words keep where scales.py would only give the ratio."""
    if math.isclose(scale, b.scale, rel_tol=1e-9):
        return
    from attnscope.usertrace.scales import explain_ratio

    ratio = scale / b.scale
    known = explain_ratio("scores", ratio, b.ctx)
    reproduced = f"{{who}} equals the reference's scores {how} instead of {_ours(b)}"
    generic = "a scale differs" in known or (named and "your scores are multiplied by" in known)
    if generic:
        yield Trial(replay(b, scale=scale), reproduced, ratio, fits)
    else:
        yield Trial(replay(b, scale=scale), known, ratio, fits, detail=reproduced)


def _scale_none(b: Base) -> Iterator[Trial]:
    """No scale; or, where --scale gives the model's own (T5's 1), the usual 1/√d_head in its place."""
    yield from _scaled(b, 1.0, "not scaled at all")
    yield from _scale_default(b)


def _scale_twice(b: Base) -> Iterator[Trial]:
    yield from _scaled(b, b.scale * b.scale, f"scaled twice ({b.scale:.4g} · {b.scale:.4g})", fits=_right_before)
    yield from _query_scaled_first(b)


def _query_scaled_first(b: Base) -> Iterator[Trial]:
    """The queries (or what they are projected from, without a bias) scaled by the scale before a kernel or code that
    scales their scores again (fairseq's and OpenNMT's q · d_head^-0.5 handed to nn.MultiheadAttention): every
    query step the reference has, from the projection on, times the scale, and the scores scaled twice. Where the
    queries are normed (a norm takes a scale before it out again), those from the norm on (modded-nanogpt's
    `norm(q) * attn_scale` handed to an attention that scales by it too); and, after a norm, from any later query
    step on (the rotated queries scaled just before the attention: the speedrun's `q * attn_scale` after RoPE)."""
    if math.isclose(b.scale, 1.0):
        return
    replayed = replay(b, q=b.q * b.scale)
    queries = [name for name in b.order if name.startswith("Q") and name in b.ref]
    starts = [0]
    if "Q_normed" in queries:
        first = queries.index("Q_normed")
        starts = list(range(first, len(queries)))
    for start in starts:
        scaled = queries[start:]
        steps = dict(replayed)
        for name in scaled:
            steps.setdefault(name, b.ref[name] * b.scale)
        yield Trial(steps, f"the scores are scaled twice: {{who}} is the reference's queries already scaled "
                    f"({_ours(b)}), and the attention then scales their scores again ({b.scale:.4g} · "
                    f"{b.scale:.4g}); scale q once, or leave the scaling to the attention that does it",
                    fits=_holds_scaled(steps, scaled))


def _holds_scaled(steps: dict[str, torch.Tensor], queries: list[str]) -> Callable[[Base, Reproduced], bool]:
    """Whether the code holds the scaled queries themselves (one of `queries`' steps as `steps` has it)."""
    from attnscope.usertrace.rerun import record_holding

    def held(b: Base, r: Reproduced) -> bool:
        return any(record_holding(b.ctx.records, _back_row(b, steps[name]), None, "", b.sums) is not None
                   for name in queries)

    return held


def _scale_half(b: Base) -> Iterator[Trial]:
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
        held = (record_holding(b.ctx.records, _back_row(b, t * half), None, "", b.sums) for t in heads if t is not None)
        record = next((r for r in held if r is not None), None)
        if record is not None:
            found.append((role, record))
    return found[0] if len(found) == 1 else None


def _whole(b: Base, told: bool, name: str) -> str:
    return f"{b.scale:.4g}" if told else f"{name}^-0.5 (1/√{name})"


def _scale_d(b: Base) -> Iterator[Trial]:
    name, d = _d(b)
    yield from _scaled(b, 1 / d, f"divided by {name} = {d}", fits=lambda b, r: not _right_before(b, r))


def _scale_d_model(b: Base) -> Iterator[Trial]:
    if b.kind != "module" or b.q.dim() < 4:
        return
    d_model = b.sizes.get("d_feat") or b.q.shape[-3] * b.d_head
    yield from _scaled(b, 1 / math.sqrt(d_model), f"divided by √d_model = {_root(d_model)}")


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
    said = f"{' = '.join(f'√{n}' for n in names.split(' = '))} = {_root(value)}" if root else f"{names} = {value}"
    what = " and ".join(SIZE_WORDS[n] for n in names.split(" = ") if n in SIZE_WORDS)
    return f"{said}, {what}," if what else said


def _scale_n(b: Base) -> Iterator[Trial]:
    """The scores divided by another size of the run than d_head (n_Q, n_K, n_head, d_model, d_V, ...), whole or
    its root, in its place or on top of the reference's own scale."""
    for names, value in _sizes(b):
        for root in (True, False):
            size = math.sqrt(value) if root else float(value)
            said = _size_words(names, value, root)
            yield from _scaled(b, 1 / size, f"divided by {said}", named=True)
            yield from _scaled(b, b.scale / size, f"divided by {said} on top of the reference's scale", named=True)


def _scale_other(b: Base) -> Iterator[Trial]:
    """The scale the code used, solved from its tensors that are the reference's scores times a constant, where no
    size of the run names it: rerun with that scale."""
    from attnscope.usertrace.align import VERY_NEGATIVE, layouts

    scores = _out(b, "scores") if "scores" in b.ref else None
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
            yield Trial(replay(b, scale=scale), f"{{who}} equals the reference's scores multiplied by {scale:.6g} "
                        f"instead of {_ours(b)}, and {scale:.6g} is no size of the run (nor its root): if it is your "
                        f"model's scale, pass --scale {scale:.6g}, else fix the scale", ratio)


def _named_scale(b: Base, scale: float) -> bool:
    """Whether another scale entry tries `scale` already (1, √d_head's kin, a size of the run)."""
    _, d = _d(b)
    known = [1.0, b.scale * b.scale, 1 / d, math.sqrt(d), 1 / math.sqrt(d), math.sqrt(b.scale)]
    for _, value in _sizes(b):
        known += [1 / math.sqrt(value), 1 / value, b.scale / math.sqrt(value), b.scale / value]
    if b.kind == "module" and b.q.dim() >= 4:
        known.append(1 / math.sqrt(b.sizes.get("d_feat") or b.q.shape[-3] * b.d_head))
    return any(math.isclose(scale, k, rel_tol=1e-5) for k in known)


def _scale_multiplied(b: Base) -> Iterator[Trial]:
    name, d = _d(b)
    yield from _scaled(b, math.sqrt(d), f"multiplied by √{name} = {_root(d)}")


def _scale_default(b: Base) -> Iterator[Trial]:
    """1/√d_head where --scale says the model's scale is another (T5's 1, Gemma 2's query_pre_attn_scalar)."""
    if b.ctx.spec is None or b.ctx.spec.scale is None:
        return
    name, d = _d(b)
    yield from _scaled(b, 1 / math.sqrt(d), f"divided by √{name} = {_root(d)}")


def _right_before(b: Base, r: Reproduced) -> bool:
    """The user's code held the right scores before it scaled them again."""
    from attnscope.usertrace.rerun import record_holding

    return "scores" in b.ref and record_holding(b.ctx.records, _out(b, "scores"), None, "", b.sums) is not None


# --- softmax --------------------------------------------------------------------------------------------------


def _softmax_axis(b: Base) -> Iterator[Trial]:
    from attnscope.usertrace.scoreaxes import keys_last

    dims = b.dims["attention"] if not b.col else (*b.dims["attention"][:-2], "n_Q", "n_K")
    # the code's own scores' layout, where the data flow says it (square scores Qᵀ K in the column form), else the
    # layout's
    keys_first = b.col if not b.ctx.keys else not keys_last(b.ctx.keys)
    for axis in range(-2, -len(dims) - 1, -1):
        where = dims[axis]
        said = f"dim={axis}" if not keys_first else f"dim={-3 - axis if axis > -3 else axis}"
        keys = "dim=-2 of scores [.., n_K, n_Q]" if keys_first else "dim=-1 of scores [.., n_Q, n_K]"
        words = (f"the softmax ran over {where}, not over n_K ({said} where the keys' axis is {keys}): {{who}} "
                 f"equals the reference's attention with the softmax over {where}, so it sums to 1 over {where} "
                 "rather than over the keys")
        yield Trial(replay(b, softmax_dim=axis), words)
        if _masked(b):  # masked with a large finite number (-1e9): a column masked whole is uniform, not NaN
            yield Trial(replay(b, softmax_dim=axis, mask="finite"), words)
            # or one added to the scores (BERT's −10000): the column keeps its scores, normalized over the queries
            yield Trial(replay(b, softmax_dim=axis, mask="added"), words)


# --- masks ----------------------------------------------------------------------------------------------------


def _masked(b: Base) -> bool:
    return b.allowed is not None and bool((~b.allowed).any()) and "masked_scores" in b.ref


def _polarity(b: Base) -> Iterator[Trial]:
    if _masked(b):
        assert b.allowed is not None
        yield Trial(replay(b, allowed=~b.allowed), "the mask is read the other way round: {who} is what the "
                    "reference computes with the mask inverted, every allowed cell masked and every masked one "
                    "allowed: True read as masked out where it means may attend, or the reverse "
                    "(nn.MultiheadAttention's attn_mask convention against the tutorials' "
                    "masked_fill(mask == 0, -1e9) and F.scaled_dot_product_attention's)")


def _after_softmax(b: Base) -> Iterator[Trial]:
    if not _masked(b):
        return
    assert b.allowed is not None
    # key padding (a --mask file's, or trace's) before the softmax, the causal or window rule after: code that
    # applies its two masks apart (CLIP's attention_mask, then causal_attention_mask). The padding is read off the
    # reference's mask: the keys it masks wherever the rule lets them be seen
    splits: list[tuple[torch.Tensor, torch.Tensor | None]] = [(b.allowed, None)]
    rule = _rule(b)
    if rule is not None:
        ruled = rule.expand_as(b.allowed)
        keys = ((b.allowed & ruled).any(-2, keepdim=True) | ~ruled.any(-2, keepdim=True)).expand_as(b.allowed)
        if bool((~keys).any()) and bool(((keys & ruled) == b.allowed).all()):
            splits.append((ruled, keys))
    for after, before in splits:
        part = "the mask" if before is None else "the causal or window rule (the key padding applied before it)"
        yield Trial(replay(b, mask="after", allowed=after, before=before), f"{part} is applied after the softmax: "
                    "{who} is what the reference computes with the unmasked scores softmaxed and the masked weights "
                    "then set to 0, so each row no longer sums to 1 and the allowed keys keep the weight the masked "
                    "ones took from them; mask the scores (masked_fill(~mask, -inf)) before the softmax")
        yield Trial(replay(b, mask="added after", allowed=after, before=before), f"{part} is added after the softmax: "
                    "{who} is what the reference computes with the unmasked scores softmaxed and the additive mask "
                    "(0 / -inf) then added to the weights, so every masked weight is -inf and the output NaN; add the "
                    "mask to the scores before the softmax")


def _zero(b: Base, multiplied: bool) -> Iterator[Trial]:
    if not _masked(b):
        return
    if multiplied:
        words = ("the mask is multiplied into the scores: {who} is what the reference computes with the masked scores "
                 "set to 0 (scores · mask), which the softmax still weighs as e^0 = 1; a boolean or 0/1 mask is "
                 "applied with masked_fill(~mask, -inf), an additive one (0 / -inf) added")
    else:
        words = ("the masked scores are filled with 0: {who} is what the reference computes with "
                 "masked_fill(~mask, 0), "
                 "and a score of 0 still gets weight e^0 = 1 in the softmax; fill with -inf (or "
                 "torch.finfo(dtype).min)")
    yield Trial(replay(b, mask="zero"), words, fits=lambda b, r: _by_mul(b, r) == multiplied)
    if not multiplied:  # the masked weights set to 0 again after the softmax (ESPnet's forward_attention), which
        # changes nothing where the scores were masked with -inf, so the reference never holds it
        yield Trial(replay(b, mask="zero, then after"), words.replace(
            "masked_fill(~mask, 0), ", "masked_fill(~mask, 0) (the masked weights then set to 0 after the softmax, "
            "as your code does), ").replace("still gets weight e^0 = 1 in the softmax",
                                             "still takes weight e^0 = 1 from the allowed keys in the softmax"),
                    fits=lambda b, r: not _by_mul(b, r))
    allowed = b.allowed
    if multiplied or allowed is None or allowed.dim() < 3 or allowed.shape[0] < 2 or "scores" not in b.ref:
        return
    # only the key padding filled with 0, the rule (causal, a window) masked with -inf: fairseq's key_padding_mask
    # filled so beside its attn_mask. The padding is what one sequence masks that another allows.
    rule = allowed.any(0, keepdim=True).expand_as(allowed)  # [n_batch, .., n_Q, n_K]
    padded = (rule & ~allowed).any(-2, keepdim=True) & ~allowed.any(-2, keepdim=True)  # [.., 1, n_K]: keys padded
    if not bool(padded.any()) or not bool((~rule).any()):
        return
    said = words.replace("masked_fill(~mask, 0)", "the padded keys' scores filled with 0 "
                         "(masked_fill(key_padding_mask, 0)<after>; the rule's other cells masked with -inf)")
    logits = b.ref["scores"] if b.bias is None else b.ref["scores"] + b.bias
    for cells, after in ((padded.expand_as(allowed), ", after the rule"), (padded & rule, ", before the rule")):
        zeroed = torch.where(cells, -logits, 0.0)  # the scores (and their bias) + this = 0 there
        bias = zeroed if b.bias is None else b.bias + zeroed
        yield Trial(replay(b, bias=bias, allowed=rule | cells), said.replace("<after>", after),
                    fits=lambda b, r: not _by_mul(b, r))
    # the other way round: the rule's cells (causal, a window) filled with 0, the padded keys masked with -inf
    # (MPT's masked_fill(causal_mask, 0) after its key padding's finfo.min)
    said = words.replace("masked_fill(~mask, 0)", "the cells the rule (causal, a window) forbids filled with 0 "
                         "(masked_fill(causal_mask, 0)<after>; the padded keys masked with -inf)")
    for cells, after in ((~rule, ", after the key padding"), (~rule & ~padded.expand_as(allowed),
                                                               ", before the key padding")):
        zeroed = torch.where(cells, -logits, 0.0)
        bias = zeroed if b.bias is None else b.bias + zeroed
        yield Trial(replay(b, bias=bias, allowed=allowed | cells), said.replace("<after>", after),
                    fits=lambda b, r: not _by_mul(b, r))


def _by_mul(b: Base, r: Reproduced) -> bool:
    """Whether the code multiplies its scores by the mask: the tensor that gave the mistake back is a product, or,
    where the line-up holds no masked scores (heads computed one at a time, picoGPT's `q @ k.T / √d * mask` inside a
    list), one of the code's products multiplies a tensor of the pattern's last two axes by a 0/1 mask of them."""
    record = r.record
    if record is not None and _is_mul(record):
        return True
    records = b.ctx.records
    return record is not None and record.func not in ("masked_fill", "where") and any(
        _is_mul(p) and p.tensor.dim() >= 2 and any(_zero_one(records[i].tensor, p.tensor.shape[-2:])
                                                    for i in p.parents if 0 <= i < len(records))
        for p in records[:record.index + 1])


def _is_mul(record: Record) -> bool:
    return record.func.strip("_").rstrip("_") in ("mul", "multiply")


def _zero_one(tensor: torch.Tensor, pattern: torch.Size) -> bool:
    """A mask of 0s and 1s, both held, over the pattern's last two axes."""
    if tensor.dim() < 2 or tensor.shape[-2:] != pattern or tensor.is_complex():
        return False
    values = tensor.detach()
    ones = values == 1
    return bool(((values == 0) | ones).all()) and bool(ones.any()) and not bool(ones.all())


def _off_by_one(b: Base) -> Iterator[Trial]:
    """The band one key wider or narrower at its right edge (a causal `tril` of diagonal 1 or -1), at its left edge
    (a sliding window of W + 1 or W - 1 keys, `triu(diagonal=-W)`), or at both (a bidirectional window written with
    `<` for `<=`); each run only where it changes the mask."""
    if not _masked(b):
        return
    assert b.allowed is not None
    allowed = b.allowed
    off = torch.zeros_like(allowed[..., :1])
    after = torch.cat((off, allowed[..., :-1]), dim=-1)  # True where the key before is allowed
    before = torch.cat((allowed[..., 1:], off), dim=-1)  # True where the key after is allowed
    window = "the window" if _has_left_edge(allowed) else "the mask's band"
    left = ("{who} is what the reference computes with the band one key {how} on the left (a sliding window of W "
            "keys is `triu(..., diagonal=-(W - 1))` on the causal mask, query i seeing keys i - W + 1 to i)")
    both = ("{{who}} is what the reference computes with the band one key {how} on each side (a window of "
            "`|i - j| <= w` is the reference's --window 2w --window-side both)")
    band, keys, rule = _band(allowed), None, None
    if band is None:  # a band beside key padding (ModernBERT's window on a padded batch): the band moved, the keys kept
        rule = _rule(b)
        keys = allowed.any(-2, keepdim=True)  # the keys some query may see: those not padded
        if rule is None or not bool(torch.equal((rule & keys).expand_as(allowed), allowed)):
            rule = None
        band = _band(rule) if rule is not None else None
    changes = [(allowed | after, "the causal band is off by 1: each query also sees the next key after it; {who} is "
                "what the reference computes with the band one key wider, `tril(..., diagonal=1)` where a causal "
                "mask is `tril(...)`, diagonal=0"),
               (allowed & before, "the mask is off by one the other way: it masks the diagonal: no query may see its "
                "own key; {who} is what the reference computes with the band one key narrower, `tril(..., "
                "diagonal=-1)` where a causal mask is `tril(...)`, diagonal=0 (a first query then sees no key: NaN)")]
    if rule is not None and keys is not None:  # the rule's right edge moved, the padded keys kept (trace's, or yours)
        changes = [(_edge_moved(rule, keys, wider), words) for wider, (_, words) in zip((True, False), changes,
                                                                                      strict=True)]
    if band is not None:  # a band lo <= j - i <= hi: its left edge moved, or both
        rel, lo, hi = band
        changes += [((rel >= lo - 1) & (rel <= hi), f"{window} is off by 1: each query also sees one key further "
                     "back than the reference lets it; " + left.replace("{how}", "wider")),
                    ((rel >= lo + 1) & (rel <= hi), f"{window} is off by 1 the other way: each query sees one key "
                     "fewer back than the reference lets it; " + left.replace("{how}", "narrower")),
                    ((rel >= lo - 1) & (rel <= hi + 1), f"{window} is off by 1 on both sides: each query also sees "
                     "one key more each way (`<=` where `<` was meant); " + both.format(how="wider")),
                    ((rel >= lo + 1) & (rel <= hi - 1), f"{window} is off by 1 on both sides: each query sees one "
                     "key fewer each way (`|i - j| < w` where `|i - j| <= w` is meant); "
                     + both.format(how="narrower"))]
    if keys is not None:  # the moved bands on the padded keys
        changes = changes[:2] + [(changed & keys, words) for changed, words in changes[2:]]
    computed = _blocks_computed(b)
    if computed is not None:  # online softmax that skips blocks (lucidrains' causal chunks wholly in the future)
        changes += [(changed & computed, f"{words} (in the blocks your code computes; it skips the others)")
                    for changed, words in changes[:2]]
    tried: list[torch.Tensor] = []
    for changed, words in changes:
        changed = changed.expand_as(allowed)
        if not bool(torch.equal(changed, allowed)) and not any(bool(torch.equal(changed, t)) for t in tried):
            tried.append(changed)
            yield Trial(replay(b, allowed=changed), words)


def _edge_moved(rule: torch.Tensor, keys: torch.Tensor, wider: bool) -> torch.Tensor:
    """The rule's band one key wider (or narrower) at its right edge, the padded keys still masked: the causal
    rule off by one beside key padding (trace's padded keys, or a --mask file's), which the code applies as it
    should."""
    off = torch.zeros_like(rule[..., :1])
    if wider:
        return (rule | torch.cat((off, rule[..., :-1]), dim=-1)) & keys  # the key after each allowed one
    return rule & torch.cat((rule[..., 1:], off), dim=-1) & keys


def _band(allowed: torch.Tensor) -> tuple[torch.Tensor, int, int] | None:
    """The mask as a band of diagonals, lo <= j - i <= hi (aligned upper-left or lower-right), the same for every
    sequence and head, with a left edge inside the matrix: (j - i, lo, hi); None for any other mask."""
    n_Q, n_K = allowed.shape[-2:]
    if allowed.dim() > 2 and not bool((allowed == allowed.reshape(-1, n_Q, n_K)[:1]).all()):
        return None
    cells = allowed.reshape(-1, n_Q, n_K)[0]
    if not bool(cells.any()):
        return None
    for shift in dict.fromkeys((0, n_K - n_Q)):
        rel = torch.arange(n_K)[None, :] - torch.arange(n_Q)[:, None] - shift
        lo, hi = int(rel[cells].min()), int(rel[cells].max())
        if bool(torch.equal((rel >= lo) & (rel <= hi), cells)) and lo > int(rel.min()):
            return rel, lo, hi
    return None


def _has_left_edge(allowed: torch.Tensor) -> bool:
    """Whether a row's first allowed key comes after a masked one (a window, not a causal band from key 0)."""
    first = allowed.int().argmax(dim=-1)
    return bool(((first > 0) & allowed.any(dim=-1)).any())


def _on_queries(b: Base) -> Iterator[Trial]:
    if not _masked(b) or b.n_Q != b.n_K:
        return
    assert b.allowed is not None
    keys = b.allowed.any(-2, keepdim=True)  # [.., 1, n_K]: a padded key is one no query may see
    rule = _rule(b)  # the reference's causal or window rule [n_Q, n_K], None without one
    if bool(keys.all()) or not bool(torch.equal(keys.expand_as(b.allowed) if rule is None else rule & keys,
                                                b.allowed)):
        return  # nothing padded, or a mask that is not key padding under the rule
    rows = keys.transpose(-1, -2)  # [.., n_Q, 1]: the padding along the queries
    on_queries = (rows if rule is None else rule & rows).expand_as(b.allowed)
    yield Trial(replay(b, allowed=on_queries), "a key-padding mask applied on the queries: {who} "
                "is what the reference computes with whole query rows masked where the padded keys' columns should be; "
                "a padded key is one no query may see, so the mask is [n_batch, 1, 1, n_K] (`mask[:, None, None, "
                ":]`), not [n_batch, 1, n_K, 1]")


def _rule(b: Base) -> torch.Tensor | None:
    """The reference's own causal or window mask [n_Q, n_K] (True = may attend), as its options say it."""
    from attnscope import masks
    from attnscope.spec import AttentionSpec

    spec = b.ctx.spec
    if spec is None or (spec.causal is None and spec.window is None):
        return None
    side = cast("WindowSide", spec.window_side)
    rule, _ = masks.structural(AttentionSpec(causal=spec.causal, window=spec.window, window_side=side), b.n_Q, b.n_K)
    return rule


def _window_rule(b: Base, window: int | None, side: str, causal: str | None) -> torch.Tensor | None:
    """The causal or window mask [n_Q, n_K] (True = may attend) of `window` keys on `side`, aligned as `causal`."""
    from attnscope import masks
    from attnscope.spec import AttentionSpec

    spec = AttentionSpec(causal=causal, window=window, window_side=cast("WindowSide", side))
    return masks.structural(spec, b.n_Q, b.n_K)[0]


def _no_window(b: Base) -> Iterator[Trial]:
    """The rule's window left out (a causal one's causal mask kept): code that forgets the sliding window."""
    spec = b.ctx.spec
    if spec is None or spec.window is None or not _masked(b):
        return
    assert b.allowed is not None
    side, w = spec.window_side, spec.window
    windowed = _window_rule(b, w, side, spec.causal)
    if windowed is None:
        return
    without = _window_rule(b, None, "left", spec.causal if side == "left" else None)
    freed = ~windowed if without is None else without & ~windowed  # the cells the window alone forbids
    changed = (b.allowed | freed).expand_as(b.allowed)
    if bool(torch.equal(changed, b.allowed)):
        return
    if side == "both":
        words = (f"the local window is missing: {{who}} is what the reference computes with its window of {w} left "
                 f"out, each query seeing every key, where query i may see only keys j with |i − j| <= {w // 2}; "
                 "mask the keys further away (`(i - j).abs() > w // 2`)")
    else:
        words = (f"the sliding window is missing: {{who}} is what the reference computes with its window of {w} left "
                 f"out and the causal mask kept, each query seeing every earlier key, where query i may see only keys "
                 f"i − {w - 1} to i; mask the keys {w} or more positions back as well (`triu(..., diagonal=-{w - 1})` "
                 "on the causal mask, Mistral's sliding_window)")
    yield Trial(replay(b, allowed=changed), words)


def _window_untold(b: Base) -> Iterator[Trial]:
    """A sliding window (or a local one, both sides) of the code's own that the reference was not told of: each width
    tried, on the reference's mask (the causal one a left window implies, where it has none)."""
    spec = b.ctx.spec
    if spec is None or spec.window is not None or "scores" not in b.ref or not _masks_more(b):
        return
    shape = b.ref["scores"].shape
    base = b.allowed if b.allowed is not None else torch.ones(shape, dtype=torch.bool)
    tried: list[torch.Tensor] = []
    for w in range(1, max(b.n_Q, b.n_K)):
        rule = _window_rule(b, w, "left", spec.causal or "upper-left")
        if rule is None:
            continue
        changed = (base & rule).expand(shape)
        if bool(torch.equal(changed, base.expand(shape))) or any(bool(torch.equal(changed, t)) for t in tried):
            continue
        tried.append(changed)
        flags = f"--window {w}" if spec.causal is not None else f"--causal --window {w}"
        yield Trial(replay(b, allowed=changed), f"your code masks with a sliding window of {w} keys, which the "
                    f"reference was not told of: {{who}} is what the reference computes with query i seeing only keys "
                    f"i − {w - 1} to i; describe it with {flags} (where that window is your model's, its "
                    "sliding_window)")
    if spec.causal is not None:
        return
    for w in range(2, 2 * max(b.n_Q, b.n_K), 2):
        rule = _window_rule(b, w, "both", None)
        if rule is None:
            continue
        changed = (base & rule).expand(shape)
        if bool(torch.equal(changed, base.expand(shape))) or any(bool(torch.equal(changed, t)) for t in tried):
            continue
        tried.append(changed)
        yield Trial(replay(b, allowed=changed), f"your code masks with a local window, |i − j| <= {w // 2}, which the "
                    f"reference was not told of: {{who}} is what the reference computes with query i seeing only the "
                    f"keys within {w // 2} of it; describe it with --window {w} --window-side both (where that window "
                    f"is your model's, ModernBERT's local_attention = {w})")


def _masks_more(b: Base) -> bool:
    """Whether the code masks cells the reference allows: a tensor of the scores' size with a masked score (very
    negative) or a weight of exactly 0 where the reference's run has neither."""
    from attnscope.usertrace.align import VERY_NEGATIVE

    numel = b.ref["scores"].numel()
    allowed = int(b.allowed.sum()) if b.allowed is not None else numel
    return any(r.tensor.is_floating_point() and r.tensor.numel() == numel
               and int(((r.tensor > VERY_NEGATIVE) & (r.tensor != 0)).sum()) < allowed for r in b.ctx.records)


def _upper_left(b: Base) -> Iterator[Trial]:
    """The causal mask aligned to the other corner where n_Q ≠ n_K: upper-left (`is_causal=True`) where the
    reference's is lower-right (a decode step, or --causal lower-right), or lower-right where --causal upper-left
    asks for the top-left corner; a key padding the reference holds kept."""
    if not _masked(b) or b.n_Q == b.n_K:
        return
    assert b.allowed is not None
    shift = b.n_K - b.n_Q
    upper = torch.ones(b.n_Q, b.n_K, dtype=torch.bool).tril()  # query i sees keys 0..i
    lower = torch.ones(b.n_Q, b.n_K, dtype=torch.bool).tril(diagonal=shift)  # query i sees keys 0..shift + i
    ours, theirs = (upper, lower) if not bool((b.allowed & ~upper).any()) else (lower, upper)
    if bool((b.allowed & ~ours).any()):  # the reference's mask is no causal band of either corner
        return
    padded = (ours & ~b.allowed).any(dim=-2, keepdim=True)  # keys masked where the band would let them in
    changed = (theirs & ~padded).expand_as(b.allowed)
    if theirs is upper:
        where = "in a decode step" if b.n_cache else f"where the {b.n_Q} queries are the last of {b.n_K} keys"
        words = (f"the causal mask is aligned upper-left {where}: {{who}} is what the reference computes where query "
                 f"i sees keys 0 to i, but the {b.n_Q} new queries come after {shift} earlier keys, so query i sees "
                 f"keys 0 to {shift} + i (lower-right). F.scaled_dot_product_attention's is_causal=True aligns its "
                 "mask to the top-left corner: pass is_causal=False with a lower-right mask "
                 "(torch.nn.attention.bias.causal_lower_right, or tril(ones(n_Q, n_K), diagonal=n_K - n_Q))")
    else:
        words = (f"the causal mask is aligned lower-right where --causal upper-left asks for the top-left corner: "
                 f"{{who}} is what the reference computes where query i sees keys 0 to {shift} + i (the last query "
                 "every key: flash-attn's and x-transformers' alignment), where upper-left query i sees keys 0 to i "
                 "(F.scaled_dot_product_attention's is_causal=True); --causal lower-right if that alignment is meant")
    if not bool(torch.equal(changed, b.allowed)):
        yield Trial(replay(b, allowed=changed), words)


# --- keys and values ------------------------------------------------------------------------------------------


def _swapped(b: Base) -> Iterator[Trial]:
    if b.k_new.shape != b.v_new.shape:
        return
    words = ("keys and values swapped: {who} is what the reference computes with K in V's place and V in K's "
             "(the scores read the values, the pattern multiplies the keys)")
    rope = _rope(b)
    if b.raw_keys is not None and rope is not None:  # the code joins its cache before RoPE, then rotates the keys
        yield from _joined_swaps(b, rope, words)
        return
    steps = replay(b, k_new=b.v_new, v_new=b.k_new)
    _feats_swapped(b, steps)
    yield Trial(steps, words)
    if "K_pooled" in b.ref and "V_pooled" in b.ref and b.ref["V_feat"].shape == b.ref["K_feat"].shape:
        # swapped before the code pools them (pooled.py): the pooled ones the reference reads are the code's own
        steps = replay(b)
        steps["K_feat"], steps["V_feat"] = b.ref["V_feat"], b.ref["K_feat"]
        yield Trial(steps, words + ", before your code pools them", fits=lambda _, r: r.held >= 2)  # both held
    if b.cache is not None:  # swapped after the cache was joined: the cached keys and values swapped too
        yield Trial(replay(b, k_new=b.v_new, v_new=b.k_new, swap_cache=True), words + ", after the cache was joined "
                    "(the cached ones swapped as well)")
    plain_k = b.plain("K")
    if rope is not None and plain_k is not None:
        rotated_v = _turn(rope)(b.v_new, rope.k_pos)  # the reference's own turn: its fraction, sign, table
        steps = replay(b, k_new=rotated_v, v_new=plain_k)
        _feats_swapped(b, steps)
        yield Trial(steps, words + ", each projected by the other's weights and then rotated as the keys are")
    yield from _swapped_before_norm(b, rope, words)


def _feats_swapped(b: Base, steps: dict[str, torch.Tensor]) -> None:
    """`steps` with K_feat and V_feat swapped, where the reference has both of one shape: the code's keys are the
    value projection's output from the first step on (`k, v = self.v_proj(x), self.k_proj(x)`)."""
    if "V_feat" in b.ref and "K_feat" in b.ref and b.ref["V_feat"].shape == b.ref["K_feat"].shape:
        steps["K_feat"], steps["V_feat"] = b.ref["V_feat"], b.ref["K_feat"]


def _swapped_before_norm(b: Base, rope: _Rope | None, words: str) -> Iterator[Trial]:
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
        turned = _turn(rope)(b.v_new, rope.k_pos)
        rotated = keys = norm(turned)
    else:
        keys = norm(b.v_new)
        rotated = _turn(rope)(keys, rope.k_pos) if rope is not None else keys
    steps = replay(b, k_new=rotated, v_new=unnormed)
    steps["K_split"], steps["K_normed"] = b.v_new, keys
    if late:
        steps["K_rot"] = turned
    _feats_swapped(b, steps)
    then = "rotated and normed" if late else "normed and rotated" if rope is not None else "normed"
    yield Trial(steps, f"{words}, each projected by the other's weights before the keys' norm (the values then {then} "
                "as the keys are)")


def _joined_swaps(b: Base, rope: _Rope, words: str) -> Iterator[Trial]:
    """kv.swapped in code that joins its cache before RoPE: swapped before the join (the values rotated as keys), once
    joined (the cached ones swapped as well), before the rotation or after it."""
    plain_k = b.plain("K")
    start = int(rope.k_pos[0]) - b.n_cache
    turn = _turn(rope)
    steps = _rejoined(b, b.q, turn, keys=b.v_new, values=plain_k, start=start)
    _feats_swapped(b, steps)
    yield Trial(steps, words + ", before the cache was joined (the values then rotated as the keys are)")
    for when, said in (("join", "before the rotation, so the values are rotated as the keys"),
                       ("turned", "after the rotation")):
        yield Trial(_rejoined(b, b.q, turn, start=start, swapped=when), f"{words}, after the cache was joined (the "
                    f"cached ones swapped as well) and {said}")


def _values_from_keys(b: Base) -> Iterator[Trial]:
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
    if _rope(b) is not None and plain_k is not None:
        yield Trial(_keys_projected(b, replay(b, v_new=plain_k)), words.replace("{how}", " before RoPE"))
    unnormed = b.ref.get("K_split")  # the keys as projected, before a qk-norm (Cohere's v from k_proj, unnormed)
    if "K_normed" in b.ref and unnormed is not None and unnormed.shape == b.v_new.shape:
        yield Trial(_keys_projected(b, replay(b, v_new=unnormed)), words.replace(
            "{how}", " as projected, before the qk-norm"))


def _keys_projected(b: Base, steps: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`steps` with V_feat the keys' projection, K_feat (`v = self.k_proj(x)`: the values' projection is the keys'
    already, so the code's values equal K_feat from the first step on, whatever is done to the keys after)."""
    if "V_feat" in b.ref and "K_feat" in b.ref and b.ref["V_feat"].shape == b.ref["K_feat"].shape:
        steps["V_feat"] = b.ref["K_feat"]
    return steps


# --- grouped-query heads --------------------------------------------------------------------------------------


def _tiled(b: Base, repeated: bool) -> Iterator[Trial]:
    if b.n_group < 2:
        return
    n_kv = b.k_new.shape[-3]
    if repeated:
        words = (f"key/value heads repeated in the wrong order: {{who}} is what the reference computes with the {n_kv} "
                 f"key/value heads tiled (0, 1, ..., 0, 1, ...), as .repeat(1, {b.n_group}, 1, 1) does, where query "
                 f"head h reads key/value head h // {b.n_group} (0, 0, ..., 1, 1, ...): "
                 f"repeat_interleave({b.n_group}, dim=1), as transformers' repeat_kv")
    else:
        words = (f"query heads grouped in the wrong order: {{who}} is what the reference computes where query head h "
                 f"reads key/value head h % {n_kv}, as a grouped einsum over q viewed as [n_batch, {b.n_group}, "
                 f"{n_kv}, ...] (n_group before n_kv_head) computes; query heads h·{b.n_group} to "
                 f"h·{b.n_group} + {b.n_group - 1} share key/value head h, so view q as [n_batch, n_kv_head, n_group, "
                 "n_Q, d_head] (transformers' repeat_kv order)")
    yield Trial(replay(b, repeat="tile"), words, fits=lambda b, r: _materializes_repeat(b) == repeated)
    if not repeated:  # the grouped result merged back in its own order, [.., n_kv_head, n_group, ..]: the output
        # projection then reads query head g·n_kv_head + kv at kv·n_group + g, as though q's heads were reordered
        order = torch.arange(b.q.shape[-3]).view(b.n_group, n_kv).t().reshape(-1)
        yield Trial(replay(b, q=b.q.index_select(-3, order)), words, fits=lambda b, r: not _materializes_repeat(b))


def _materializes_repeat(b: Base) -> bool:
    if "K_rep" not in b.ref:
        return False
    shape = sorted(_out(b, "K_rep").shape)  # in any order: [.., n_head, n, d], or [.., n, n_head, d] repeated
    records = b.ctx.records                 # before the transpose (Mistral's repeat_kv on dim=2)
    return any(sorted(r.tensor.shape) == shape
               and (r.func in ("repeat", "repeat_interleave", "expand", "index_select", "cat", "tile")
                    or r.func in ("reshape", "view", "flatten") and r.parents
                    and records[r.parents[0]].func == "expand")
               for r in records)


# --- heads split and merged -----------------------------------------------------------------------------------


def _merge(b: Base) -> Iterator[Trial]:
    yield from _returned_merge(b)
    if "x_rsh2" in b.ref and "x_raw" in b.ref and b.ref["x_raw"].dim() == 4:
        yield Trial(replay(b, merge="view"), "heads merged in the wrong order: {who} is what the reference computes "
                    "with x_raw [n_batch, n_head, n_Q, d_head] viewed as [n_batch, n_Q, d_feat] without first moving "
                    "n_head behind n_Q (view before permute), so each row mixes the positions of one head; "
                    ".permute(0, 2, 1, 3).contiguous() before the view")
        n_batch, n_Q = b.ref["x_raw"].shape[0], b.ref["x_raw"].shape[2]
        if n_batch != n_Q and any(tuple(r.tensor.shape[:2]) == (n_Q, n_batch) for r in b.ctx.records
                                  if r.tensor.dim() == 3):  # time-first code (usertrace/timefirst.py)
            yield Trial(replay(b, merge="time"), "heads merged in the wrong order: {who} is what the reference "
                        "computes with x_raw as [n_batch·n_head, n_Q, d_head] viewed straight as time-first "
                        "[n_Q, n_batch, d_feat] without first moving n_Q in front (view before transpose), so each "
                        "row mixes the positions and heads of one sequence; .transpose(0, 1).contiguous() before the "
                        "view")


def _merge_permuted(b: Base) -> Iterator[Trial]:
    """x_raw `[n_batch, n_head, n_Q, d_head]` permuted another way than (0, 2, 1, 3) before the view to `[n_batch,
    n_Q, d_feat]` (einops' `'b h n d -> b n (d h)'`: the head index the fastest), the output projection reading it
    so."""
    if "x_rsh2" not in b.ref or "x_raw" not in b.ref or b.ref["x_raw"].dim() != 4 or b.col:
        return
    dims = ("n_batch", "n_head", "n_Q", "d_head")
    for order in ((0, 2, 3, 1), (0, 1, 3, 2), (0, 3, 1, 2), (0, 3, 2, 1)):
        steps = replay(b)
        x_raw = steps.get("x_raw")
        if x_raw is None or x_raw.dim() != 4:
            return
        n_batch, n_head, n_Q, d = x_raw.shape
        merged = x_raw.permute(order).reshape(n_batch, n_Q, n_head * d)
        steps.pop("x_rsh1", None)
        steps["x_rsh2"] = merged
        if b.gate is not None and "x_gated" in steps:  # the code's output gate (outgate.py), where it gates
            merged = (x_raw * b.gate).permute(order).reshape(n_batch, n_Q, n_head * d) if b.gate_first \
                else merged * steps["gate"]
            steps["x_gated"] = merged
        if "x" in steps and b.w_o is not None:
            steps["x"] = torch.nn.functional.linear(merged, *b.w_o)
        became = ", ".join(dims[a] for a in order)
        yield Trial(steps, f"heads merged with the wrong permute: {{who}} is what the reference computes with x_raw "
                    f"[n_batch, n_head, n_Q, d_head] permuted {order} to [{became}], then viewed as [n_batch, n_Q, "
                    "d_feat], so each row holds the heads' features in another order than the output projection "
                    "reads; .permute(0, 2, 1, 3) (or .transpose(1, 2), einops' 'b h n d -> b n (h d)') gives "
                    "[n_batch, n_Q, n_head, d_head], then .reshape")


def _returned_merge(b: Base) -> Iterator[Trial]:
    """What a call returns, where it is the divergence (lineup._return_differs): the last step as the code holds it
    (`attn @ v`, [n_batch·n_head, n_Q, d_V] say) reshaped straight into the returned tensor's shape, the heads never
    moved behind the queries (xformers' BMHK output without its permute back)."""
    returned, last = b.ctx.returned, b.last
    if returned is None or b.col or b.ref[last].dim() != 4 or "n_head" not in b.dims[last]:
        return
    from attnscope.usertrace.align import compare, layouts
    from attnscope.usertrace.rerun import record_holding

    right = b.ref[last]
    inner = record_holding(b.ctx.records, right, None, "", b.sums)  # the code's own tensor of the last step
    if inner is None:
        return
    held = compare(inner, right)[0].layout
    into = [layout for layout in layouts(tuple(right.shape), tuple(returned.tensor.shape))
            if not layout.same and layout.split is None]
    if not into:
        return
    steps = replay(b)
    # the run's last step laid out as the code holds it, then reshaped straight into the returned shape
    wrong = held.apply(steps[last], tuple(inner.tensor.shape)).reshape(returned.tensor.shape)
    steps[last] = into[0].undo(wrong, tuple(right.shape))
    dims = b.dims[last]
    target = ", ".join(dims[i] for i in into[0].order)
    kept = f" (as your code holds it, {list(inner.tensor.shape)})" if tuple(inner.tensor.shape) != tuple(right.shape) \
        else ""
    order = ", ".join(str(i) for i in into[0].order)
    yield Trial(steps, f"heads merged in the wrong order: {{who}} is what the reference computes with {last} "
                f"[{', '.join(dims)}]{kept} reshaped straight to {list(returned.tensor.shape)}, without first "
                f"moving its axes into the order [{target}], so each row mixes positions and heads; .permute({order}) "
                f"it from [{', '.join(dims)}] before the reshape")


def _split(b: Base) -> Iterator[Trial]:
    """Each of Q, K and V split by a view without the transpose (one helper for all three: all of them), then
    rotated where the reference rotates. A module's X_feat [n_batch, n, d_feat] viewed straight as [n_batch,
    n_head, n, d_head]; a function's inputs with the heads behind the tokens, [n_batch, n, n_head, d] (xformers'
    BMHK), reshaped straight to [n_batch·n_head, n, d]."""
    if b.kind != "module" and b.ctx.layout != "bthd":
        return
    rope = _rope(b)
    if b.kind == "module":  # a fused projection's output reshaped straight, then split (usertrace/fusedsplit.py)
        from attnscope.usertrace import fusedsplit

        def turn(x: torch.Tensor, role: str) -> torch.Tensor:
            assert rope is not None
            return _turn(rope)(x, rope.q_pos if role == "Q" else rope.k_pos)

        for steps, words in fusedsplit.trials(b, turn if rope is not None else None):
            yield Trial(steps, words)
    wrong: dict[str, dict[str, torch.Tensor]] = {}  # role -> the replay's change, and the steps the view makes
    for role, change, name in (("Q", "q", "Q_rot"), ("K", "k_new", "K_rot"), ("V", "v_new", "")):
        feat, split = (f"{role}_feat", f"{role}_split") if b.kind == "module" else (role, role)
        feat = f"{role}_pooled" if f"{role}_pooled" in b.ref else feat  # pooled after the projection (pooled.py)
        normed = f"{role}_normed" if b.kind == "module" and f"{role}_normed" in b.ref else None
        if feat not in b.ref or split not in b.ref or b.ref[split].dim() != 4:
            continue
        if b.names[change[0]] not in (split, name, normed):  # another step between the split and the attention
            continue
        shape = b.ref[split].shape
        if normed is not None and b.ref[normed].shape != shape:
            # a norm over the whole projection (OLMo 2's), before the split: the view takes the normed projection
            views = {split: b.ref[normed].reshape(shape)}
        else:
            # [n_batch, n, d_feat] read as [n_batch, n_head, n, d_head]; a function's [n_batch, n, n_head, d] so too
            source = b.ref[feat] if b.kind == "module" else b.ref[feat].transpose(1, 2).contiguous()
            viewed = source.reshape(shape)
            # a norm of each head's d_head (Persimmon's q_layernorm on [n_batch, n, n_head, d_head] before the view,
            # SD3's norm_q after it): the view keeps each row of d_head whole, so the norm and the view give the
            # reference's norm viewed so (one gain that every head shares)
            views = {split: viewed} if normed is None else {
                split: viewed, normed: b.ref[normed].transpose(1, 2).contiguous().reshape(shape)}
        plain = views.get(normed or "", views[split])
        turned = _turn(rope)(plain, rope.q_pos if role == "Q" else rope.k_pos) \
            if rope is not None and role != "V" else plain
        wrong[role] = {change: turned, **views}
    yield from _split_trials(b, wrong)


def _split_trials(b: Base, wrong: dict[str, dict[str, torch.Tensor]]) -> Iterator[Trial]:
    runs = [[role] for role in wrong] + ([list(wrong)] if len(wrong) > 1 else [])
    for roles in runs:
        changes = {"Q": "q", "K": "k_new", "V": "v_new"}
        changed = {changes[r]: wrong[r][changes[r]] for r in roles}
        splits = {step: t for r in roles for step, t in wrong[r].items() if step != changes[r]}
        if b.kind != "module":  # a function's split is its q itself, or what RoPE then turns
            splits = {name: t for name, t in splits.items() if b.names[changes[name][0]] != name}
        steps = {**replay(b, **changed), **splits}  # type: ignore[arg-type]
        n = "n_Q" if roles[0] == "Q" else "n_K"
        if b.kind != "module":
            d = "d_V" if roles[0] == "V" else "d_K"
            also = f" ({' and '.join(roles[1:])} split the same way)" if len(roles) > 1 else ""
            yield Trial(steps, f"heads split without the transpose: {{who}} is what the reference computes with "
                        f"{roles[0]} as your code takes it, [n_batch, {n}, n_head, {d}], reshaped straight to "
                        f"[n_batch·n_head, {n}, {d}] or viewed as [n_batch, n_head, {n}, {d}]{also}, so each head "
                        f"holds a run of positions of several heads, not one head of every position; .permute(0, 2, "
                        f"1, 3) (or .transpose(1, 2)) to [n_batch, n_head, {n}, {d}] before the reshape")
            continue
        also = f" ({' and '.join(f'{r}_feat' for r in roles[1:])} split the same way)" if len(roles) > 1 else ""
        yield Trial(steps, f"heads split without the transpose: {{who}} is {roles[0]}_feat [n_batch, {n}, d_feat] "
                    f"viewed straight as [n_batch, n_head, {n}, d_head]{also}, so each head holds a run of whole "
                    f"feature rows of several positions, not one slice of every position; view as [n_batch, {n}, "
                    "n_head, d_head], then .transpose(1, 2)")


# --- RoPE -----------------------------------------------------------------------------------------------------


@dataclass
class _Rope:
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


def _rope(b: Base) -> _Rope | None:
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
        if _near(_rotate(q, pos, spec.rope_base, pairing, rotary=rotary, sign=sign, freqs=freqs, angles=angles),
                 b.ref["Q_rot"]):
            q_pos = pos
            break
    for start in dict.fromkeys((b.n_cache + first, first, 0)):
        pos = torch.arange(start, start + n_new)
        if _near(_rotate(k, pos, spec.rope_base, pairing, rotary=rotary, sign=sign, freqs=freqs, angles=angles),
                 b.ref["K_rot"]):
            k_pos = pos
            break
    if q_pos is None or k_pos is None:
        return None
    return _Rope(float(spec.rope_base), pairing, q_pos, k_pos, q, k, rotary, sign, freqs, angles)


def _turn(rope: _Rope) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """x `[.., n, d]` at `positions` rotated as the reference's RoPE turns them."""
    return lambda x, positions: _rotate(x, positions, rope.base, rope.pairing, rotary=rope.rotary, sign=rope.sign,
                                        freqs=rope.freqs, angles=rope.angles)


def _near(mine: torch.Tensor, reference: torch.Tensor) -> bool:
    from attnscope.usertrace.align import difference, tolerance

    return tuple(mine.shape) == tuple(reference.shape) and difference(mine, reference) <= tolerance(reference.float())


def _rotate(x: torch.Tensor, positions: torch.Tensor, base: float, pairing: str, table: str | None = None,
            rotary: int | None = None, over: int | None = None, sign: int = 1,
            freqs: tuple[float, ...] | None = None, angles: torch.Tensor | None = None) -> torch.Tensor:
    """x `[.., n, d]` rotated in float64: `pairing` "half" (rotate_half: i with i + r/2) or "interleaved" (2i with
    2i + 1); `table` how the angles are laid along the coordinates ("cat": (θ, θ) as transformers' `cat((freqs,
    freqs))`; "interleave": θ0, θ0, θ1, θ1, ... as `repeat_interleave(2)`), the pairing's own by default; only the
    first `rotary` coordinates rotated (GPT-NeoX's rotary_pct), the rest passed through; `over`: the width the
    frequencies are spread over (the rotated width, as GPT-NeoX's rotary_ndims, unless said); `sign` -1 turns each
    pair by −θ (nanochat's); `freqs`: each pair's frequency, read from the code (ropefreqs.py), in place of the
    base's; `angles`: each position's pair's angle `[n, d/2]` (ropefreqs.Angles), in place of both (positions past
    the table turn by its rows taken cyclically: a trial that no code of the table's tokens reproduces)."""
    x = x.double()
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


def _rotated(b: Base, rope: _Rope, q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
             base: float | None = None, pairing: str | None = None, table: str | None = None,
             rotary: int | None = None, over: int | None = None) -> dict[str, torch.Tensor]:
    """The reference run again with its queries and keys rotated another way (the rest as the reference's)."""
    own = base is None and rotary is None and over is None  # the code's own table
    freqs, angles = (rope.freqs, rope.angles) if own else (None, None)
    base, pairing, rotary = base or rope.base, pairing or rope.pairing, rotary or rope.rotary

    def turn(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return _rotate(x, positions, base, pairing, table, rotary, over, rope.sign, freqs, angles)

    q = turn(rope.q, rope.q_pos if q_pos is None else q_pos)
    k_pos = rope.k_pos if k_pos is None else k_pos
    if b.raw_keys is not None:  # the code rotates the joined keys: the cached ones turn the same way
        return _rejoined(b, q, turn, start=int(k_pos[0]) - b.n_cache)
    return replay(b, q=q, k_new=turn(rope.k, k_pos))


def _rejoined(b: Base, q: torch.Tensor, turn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None, *,
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


PAIRS = {"half": "half-split, (i, i + d_head/2), as transformers' LLaMA rotate_half does",
         "interleaved": "interleaved, (0, 1), (2, 3), ... (GPT-J, Meta's view_as_complex)"}
TABLES = {"cat": "a half-split table (cat((freqs, freqs)), each angle on i and i + d_head/2)",
          "interleave": "an interleaved table (freqs.repeat_interleave(2), each angle on 2i and 2i + 1)"}


def _pairing(b: Base) -> Iterator[Trial]:
    if "Q_pe_rot" in b.ref:  # latent attention (usertrace/latentref.py): its rotary parts alone turn
        yield from _latent_pairing(b)
        return
    rope = _rope(b)
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
        q_rot = _rotate(q_pe, torch.arange(q_pe.shape[-2]), spec.rope_base, pairing)
        k_rot = _rotate(k_pe, torch.arange(k_pe.shape[-2]), spec.rope_base, pairing)  # [n_batch, n_K, d_rope]
        shared = k_rot[:, None].expand(-1, n_head, -1, -1)
        steps = replay(b, q=torch.cat([b.ref["Q_nope"], q_rot], dim=-1),
                       k_new=torch.cat([b.ref["K_nope"], shared], dim=-1))
        steps["Q_pe_rot"] = q_rot
        yield Trial(steps, f"{{who}} turns the rotary parts {PAIRS[pairing]}, where the reference turns the "
                    f"checkpoint's pairs {LATENT_PAIRS[pairing]}; if your weights are laid out for yours, pass "
                    f"--rope-pairing {'half-split' if pairing == 'half' else 'interleaved'}")


LATENT_PAIRS = {"half": "interleaved, as DeepSeek-V2/V3 do (as complex numbers, or gathered even then odd first)",
                "interleaved": "half-split, as MiniCPM3 does"}


def _positions(b: Base) -> Iterator[Trial]:
    rope = _rope(b)
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


def _joined_positions(b: Base, rope: _Rope) -> Iterator[Trial]:
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


def _base(b: Base) -> Iterator[Trial]:
    from attnscope.usertrace.rotary import KNOWN_BASES

    rope = _rope(b)
    if rope is None:
        return
    own = b.ctx.spec is not None and b.ctx.spec.base_from_module
    for base in KNOWN_BASES:
        if base == rope.base:
            continue
        if own:  # the module says its base, and rotates with another: a bug, whatever the model
            words = (f"{{who}} rotates with RoPE base {base:g} where your module says {rope.base:g} (its rope_theta "
                     f"or base): the base is not handed on to where the rotation's frequencies are made "
                     f"(base ** (-2i / d_head) with base = {base:g}); pass the module's own")
        else:
            words = (f"{{who}} rotates with RoPE base {base:g} where the reference uses {rope.base:g}; if your model "
                     f"was trained with rope_theta = {base:g}, pass --rope-base {base:g}, else fix the base")
        yield Trial(_rotated(b, rope, base=base), words)
    yield from _scaled_base(b, rope, own)


def _scaled_base(b: Base, rope: _Rope, own: bool) -> Iterator[Trial]:
    """rope.base under linear scaling: the queries and keys the code hands its scores turn at another known base's
    frequencies over one factor (positions t / f), where the reference's base (over that factor, a convention) does
    not give them."""
    from dataclasses import replace

    from attnscope.usertrace import ropefreqs
    from attnscope.usertrace.rotary import KNOWN_BASES

    if rope.freqs is not None or rope.angles is not None or rope.rotary is not None or b.n_cache:
        return
    read = ropefreqs.from_code(b.ctx.records, rope.q, rope.k, 0)
    if read is None or read[0].sign != rope.sign or (read[1] == "interleaved") != (rope.pairing == "interleaved"):
        return
    table = read[0]
    for base in (x for x in KNOWN_BASES if x != rope.base):
        factor = ropefreqs.linear_factor(table, base, rope.q.shape[-1])
        if factor is None:
            continue
        scaled = f"RoPE base {base:g}, positions scaled by 1/{factor:g} (its linear RoPE scaling),"
        words = (f"{{who}} rotates with {scaled} where your module says base {rope.base:g} (its rope_theta or base): "
                 "the base is not handed on to where the rotation's frequencies are made; pass the module's own"
                 if own else f"{{who}} rotates with {scaled} where the reference uses base {rope.base:g}; if your "
                 f"model was trained with rope_theta = {base:g}, pass --rope-base {base:g}, else fix the base")
        yield Trial(_rotated(b, replace(rope, freqs=table.freqs)), words)


def _fraction(b: Base) -> Iterator[Trial]:
    """A rotary fraction where the reference rotates all (or the other way round), and a fraction whose
    frequencies are spread over the whole head instead of the rotated part."""
    rope = _rope(b)
    if rope is None:
        return
    d = b.d_head
    if rope.rotary is not None:
        r = rope.rotary
        yield Trial(_rotated(b, rope, over=d), f"RoPE's frequencies are spread over the whole head: {{who}} is what "
                    f"the reference computes with the first {r} of d_head = {d} coordinates turning at base^(-2i / "
                    f"{d}) where a rotary fraction turns them at base^(-2i / {r}) (GPT-NeoX's inv_freq over "
                    "rotary_ndims)")
        said = b.ctx.spec is not None and b.ctx.spec.fraction_from_module
        yield Trial(_rotated(b, rope, rotary=d), f"RoPE rotates the whole head: {{who}} is what the reference computes "
                    f"with all d_head = {d} coordinates rotated, where only the first {r} turn (a rotary fraction of "
                    f"{r / d:g}) and the rest pass through" + (
                        " (your module's config says so: its rotary_dim, rotary_pct or partial_rotary_factor); "
                        "rotate the first rotary_dim coordinates of each head" if said else ""))
        return
    for share in (0.25, 0.5):
        r = int(d * share)
        if r >= 2 and r % 2 == 0:
            yield Trial(_rotated(b, rope, rotary=r), f"RoPE rotates only part of each head: {{who}} is what the "
                        f"reference computes with the first {r} of d_head = {d} coordinates rotated (a rotary "
                        f"fraction of {share:g}, GPT-NeoX's rotary_pct) and the rest passed through, where the "
                        "reference rotates all of them")
            yield Trial(_rotated(b, rope, rotary=r, over=d), f"RoPE's frequencies are spread over the whole head: "
                        f"{{who}} is what the reference computes with the first {r} of d_head = {d} coordinates "
                        f"turning at base^(-2i / {d}) where a rotary fraction turns them at base^(-2i / {r}) "
                        "(GPT-NeoX's inv_freq over rotary_ndims)")


def _on_values(b: Base) -> Iterator[Trial]:
    rope = _rope(b)
    if rope is None or b.v_new.shape[-1] % 2:
        return
    if b.raw_keys is not None:  # the joined values rotated with the joined keys
        steps = _rejoined(b, b.q, _turn(rope),
                          start=int(rope.k_pos[0]) - b.n_cache, turn_values=True)
    else:
        steps = replay(b, v_new=_turn(rope)(b.v_new, rope.k_pos))
    yield Trial(steps,
                "RoPE applied to the "
                "values: {who} is what the reference computes with V rotated as the keys are; RoPE rotates only the "
                "queries and the keys (their dot products then depend on the distance i − j), the values are "
                "taken as they are")


def _not_applied(b: Base) -> Iterator[Trial]:
    rope = _rope(b)
    if rope is not None:
        steps = _rejoined(b, rope.q, None) if b.raw_keys is not None else replay(b, q=rope.q, k_new=rope.k)
        yield Trial(steps, f"RoPE is never applied: {{who}} is what the reference computes "
                    f"with the queries and keys not rotated (the reference rotates them, --rope, base "
                    f"{rope.base:g})")


def _untold(b: Base) -> Iterator[Trial]:
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
        hint = " --rope-pairing interleaved" if turn == "interleaved" else ""
        yield Trial(replay(b, q=_rotate(b.q, q_pos, 10000.0, turn, sign=table.sign, freqs=table.freqs),
                           k_new=_rotate(b.k_new, k_pos, 10000.0, turn, sign=table.sign, freqs=table.freqs)),
                    f"your code rotates q and k by RoPE ({table.words()}; pairing {pairing}), which the reference "
                    f"was not told of: {{who}} is what the reference computes so rotated; describe it with "
                    f"--rope{hint} (its frequencies are then read from your code)")
    for pairing in ("half", "interleaved"):
        hint = " --rope-pairing interleaved" if pairing == "interleaved" else ""
        yield Trial(replay(b, q=_rotate(b.q, q_pos, 10000.0, pairing), k_new=_rotate(b.k_new, k_pos, 10000.0, pairing)),
                    f"your code rotates q and k by RoPE (base 10000, pairing {PAIRS[pairing].split(',')[0]}), "
                    f"which the reference was not told of: {{who}} is what the reference computes so rotated; "
                    f"describe it with --rope{hint}")


# --- ALiBi and T5's bias --------------------------------------------------------------------------------------


def _alibi_parts(b: Base) -> tuple[torch.Tensor, int] | None:
    """The reference's ALiBi slopes and the position of query 0, where it adds ALiBi."""
    from attnscope.variants import alibi

    spec = b.ctx.spec
    if spec is None or not spec.alibi or "alibi_bias" not in b.ref or b.q.dim() < 3 or b.bias is None:
        return None
    n_head = b.q.shape[-3]
    slopes = alibi.slopes(n_head).double()
    return slopes, b.n_K - b.n_Q


def _alibi_bias(b: Base, slopes: torch.Tensor, offset: int, symmetric: bool = False) -> torch.Tensor:
    i = torch.arange(b.n_Q, dtype=torch.float64)[:, None] + offset
    j = torch.arange(b.n_K, dtype=torch.float64)[None, :]
    distance = (i - j).abs() if symmetric else i - j
    return -slopes[:, None, None] * distance  # [n_head, n_Q, n_K]


def _alibi_sign(b: Base) -> Iterator[Trial]:
    parts = _alibi_parts(b)
    if parts is not None:
        assert b.bias is not None
        yield Trial(replay(b, bias=-b.bias), "ALiBi's sign is flipped: {who} is what the reference computes with the "
                    "bias +m_h · (i − j) added where ALiBi adds −m_h · (i − j): distant keys gain weight instead of "
                    "losing it; the slopes are positive and the bias m_h · (j − i) (BLOOM's m_h · j)")


def _alibi_slopes(b: Base) -> Iterator[Trial]:
    parts = _alibi_parts(b)
    if parts is None:
        return
    slopes, offset = parts
    n_head = slopes.numel()
    said = ", ".join(f"{m:.4g}" for m in slopes.tolist())
    others = [("in reverse head order", slopes.flip(0)),
              ("2^(-8 h / n_head) counted from h = 0", torch.tensor([2 ** (-8 * h / n_head) for h in range(n_head)],
                                                                      dtype=torch.float64)),
              ("2^(-h), without the 8 / n_head", torch.tensor([2.0 ** -(h + 1) for h in range(n_head)],
                                                               dtype=torch.float64)),
              ("all 1", torch.ones(n_head, dtype=torch.float64))]
    for how, m in [*others, ("fitted from your scores", _fit(b, offset))]:
        if m is None or torch.allclose(m, slopes):
            continue
        mine = ", ".join(f"{x:.4g}" for x in m.tolist())
        yield Trial(replay(b, bias=_alibi_bias(b, m, offset)), f"ALiBi's slopes are wrong: {{who}} is what the "
                    f"reference computes with slopes {mine} ({how}), which are not ALiBi's for {n_head} heads "
                    f"({said}: 2^(-8 h / n_head), h = 1 to n_head)")


def _fit(b: Base, offset: int) -> torch.Tensor | None:
    """Per head, the slopes m of the user's biased scores less the reference's unbiased ones = m · j + a constant
    per row, from the first user tensor of the scores' shape where one such fit holds."""
    from attnscope.usertrace.maskcauses import fit_slopes

    scores = b.ref["scores"]
    for record in b.ctx.records:
        if tuple(record.tensor.shape) != tuple(_out(b, "scores").shape) or not record.tensor.is_floating_point():
            continue
        slopes = fit_slopes(_back_row(b, record.tensor.double()), scores, False)
        if slopes is not None:
            return torch.tensor([float(f"{m:.6g}") for m in slopes.tolist()], dtype=torch.float64)
    return None


def _alibi_queries(b: Base) -> Iterator[Trial]:
    parts = _alibi_parts(b)
    if parts is not None:
        slopes, offset = parts
        yield Trial(replay(b, bias=_alibi_bias(b, slopes, offset, symmetric=True)), "ALiBi's query positions: {who} "
                    "is what the reference computes with the bias −m_h · |i − j|, symmetric in the query and key "
                    "positions, where ALiBi adds −m_h · (i − j) = m_h · (j − i), a constant per query row plus m_h · j "
                    "(BLOOM's): keys after the query are pushed down as those before are")


def _t5(b: Base) -> bool:
    return b.ctx.spec is not None and b.ctx.spec.position_bias is not None and b.bias is not None


def _t5_transposed(b: Base) -> Iterator[Trial]:
    if _t5(b) and b.n_Q == b.n_K:
        assert b.bias is not None
        yield Trial(replay(b, bias=b.bias.transpose(-1, -2)), "the position bias is transposed: {who} is what the "
                    "reference computes with bias[j, i] added to score (i, j) where T5 adds bias[i, j] (its "
                    "relative_position = memory_position − context_position, keys minus queries)")


def _t5_after_softmax(b: Base) -> Iterator[Trial]:
    if _t5(b):
        yield Trial(replay(b, bias=None, after_softmax=b.bias), "the position bias is added after the softmax: {who} "
                    "is what the reference computes with the bias added to the attention weights, not to the "
                    "scores; T5 "
                    "adds position_bias to the scores before the softmax")


# --- softcap ----------------------------------------------------------------------------------------------------


def _cap_origin(b: Base) -> str:
    spec = b.ctx.spec
    if spec is not None and spec.softcap_from_module:
        return f"the softcap your module's config says, {b.softcap:g},"
    return f"--softcap {b.softcap:g}"


def _softcap_missing(b: Base) -> Iterator[Trial]:
    if b.softcap is not None:
        c = f"{b.softcap:g}"
        yield Trial(replay(b, softcap=None), f"the scores are never capped: {{who}} is what the reference computes "
                    f"without the softcap, where {_cap_origin(b)} caps them, {c} · tanh(scores / {c}), before the "
                    f"mask; cap them (scores = {c} * torch.tanh(scores / {c}), Gemma 2's attn_logit_softcapping)")


def _softcap_after_mask(b: Base) -> Iterator[Trial]:
    if b.softcap is not None and _masked(b):
        c = f"{b.softcap:g}"
        yield Trial(replay(b, cap="after mask"), f"the softcap is applied after the mask: {{who}} is what the "
                    f"reference computes with the masked scores capped, so a masked score (-inf, finfo.min) becomes "
                    f"-{c} and the keys the mask forbids keep a weight of e^-{c}; cap the scores, {c} · "
                    f"tanh(scores / {c}), before adding the mask")


def _softcap_form(b: Base) -> Iterator[Trial]:
    if b.softcap is None:
        return
    c = f"{b.softcap:g}"
    yield Trial(replay(b, cap="no multiply"), f"the softcap is not multiplied back: {{who}} is what the reference "
                f"computes with the scores tanh(scores / {c}), between -1 and 1, where the cap is {c} · tanh(scores / "
                f"{c}); multiply by {c} after the tanh")
    yield Trial(replay(b, cap="no divide"), f"the softcap does not divide first: {{who}} is what the reference "
                f"computes with the scores {c} · tanh(scores), where the cap is {c} · tanh(scores / {c}); divide by "
                f"{c} before the tanh")
    if not math.isclose(b.scale, 1.0):
        yield Trial(replay(b, cap="unscaled"), f"the softcap is applied before the scale: {{who}} is what the "
                    f"reference computes with q · kᵀ capped, {c} · tanh(q · kᵀ / {c}), and scaled after, where the "
                    f"scaled scores are capped, {c} · tanh(scale · q · kᵀ / {c}); scale first, then cap")


def _softcap_untold(b: Base) -> Iterator[Trial]:
    """A cap of the code's own the reference was not told of: C solved from the user's tensors that are the scores
    capped."""
    if b.softcap is not None or "scores" not in b.ref:
        return
    for c in dict.fromkeys(_caps_solved(b)):
        said = f"{c:g}"
        yield Trial(replay(b, softcap=c), f"your code caps the scores, {said} · tanh(scores / {said}), which the "
                    f"reference was not told of: {{who}} is what the reference computes so capped; if that cap is "
                    f"your model's (Gemma 2's attn_logit_softcapping), describe it with --softcap {said}")


def _softcap_value(b: Base) -> Iterator[Trial]:
    """The code caps at another C than the reference's, C solved from its capped scores."""
    if b.softcap is None or "scores" not in b.ref:
        return
    for c in dict.fromkeys(_caps_solved(b)):
        if math.isclose(c, b.softcap, rel_tol=1e-4):
            continue
        said = f"{c:g}"
        yield Trial(replay(b, softcap=c), f"your code caps the scores at {said}, not {b.softcap:g}: {{who}} is what "
                    f"the reference computes with {said} · tanh(scores / {said}), where {_cap_origin(b)} caps them "
                    f"at {b.softcap:g} · tanh(scores / {b.softcap:g}); cap with your model's attn_logit_softcapping "
                    f"(or give it with --softcap)")


def _caps_solved(b: Base) -> list[float]:
    """C where one of the user's tensors is the reference's scores capped, C · tanh(scores / C): solved on its
    largest score (C · tanh(s / C) grows with C towards s), then checked on all."""
    from attnscope.usertrace.align import VERY_NEGATIVE, layouts

    scores = _out(b, "scores")
    found: list[float] = []
    for record in b.ctx.records:
        user = record.tensor
        if not user.is_floating_point() or user.numel() != scores.numel() or user.dim() < 2:
            continue
        for layout in layouts(tuple(scores.shape), tuple(user.shape))[:2]:
            s = layout.apply(scores, tuple(user.shape)).double()
            y = user.double()
            kept = torch.isfinite(y) & (y > VERY_NEGATIVE) & torch.isfinite(s)
            s, y = s[kept], y[kept]
            if s.numel() < 2:
                continue
            top = int(s.abs().argmax())
            big, capped = abs(float(s[top])), float(y[top]) * (1.0 if float(s[top]) >= 0 else -1.0)
            if not 0 < capped < big * (1 - 1e-4):
                continue
            low, high = 1e-6 * big, 1e6 * big
            for _ in range(200):  # C · tanh(big / C) = capped, increasing in C
                mid = math.sqrt(low * high)
                low, high = (mid, high) if mid * math.tanh(big / mid) < capped else (low, mid)
            c = math.sqrt(low * high)
            tol = 1e-4 * max(float(y.abs().max()), 1e-12)
            # the cap is ill-conditioned where the scores are small beside it: the roundest C that fits
            fits = [r for r in (float(f"{c:.{n}g}") for n in (1, 2, 3, 4, 6))
                    if float((r * torch.tanh(s / r) - y).abs().max()) <= tol]
            if fits:
                found.append(fits[0])
    return found


# --- cache, precision, dropout --------------------------------------------------------------------------------


def _join_dim(b: Base) -> str:
    """The axis the code joins its cache on, as its own torch.cat writes it (`dim=1` where it keeps the cache
    sequence-major, cachelayouts.py); `dim=-2`, transformers' layout's, where no join of a cache input is seen."""
    from attnscope.usertrace.cachelayouts import join

    found = join(b.ctx.records)
    return f"dim={found[1]}" if found is not None else "dim=-2"


def _cache_order(b: Base) -> Iterator[Trial]:
    if b.cache is None:
        return
    n_new, past = int(b.k_new.shape[-2]), b.n_cache
    words = (f"the cache is joined in the wrong order: {{who}} is what the reference computes with the {n_new} new "
             f"keys and values before the {past} cached ones, torch.cat([k, k_cache]) where the cached positions come "
             f"first: torch.cat([k_cache, k], {_join_dim(b)})")
    rope = _rope(b) if b.raw_keys is not None else None
    if rope is None:
        yield Trial(replay(b, cat_order="new first"), words)
        return
    # the code rotates the join: the new keys turn at the cache's positions 0 .. n_new − 1, the cached ones after
    steps = _rejoined(b, b.q, _turn(rope),
                      start=int(rope.k_pos[0]) - past, new_first=True)
    yield Trial(steps, words.replace(" where the cached", f", then rotated together, so the new keys turn at "
                                     f"positions 0 to {n_new - 1}, where the cached"))


def _float16(b: Base) -> Iterator[Trial]:
    if not any(r.tensor.dtype in (torch.float16, torch.bfloat16) for r in b.ctx.records):
        return
    steps = replay(b, half=True)
    if bool(torch.isinf(steps["scores"]).any()):
        yield Trial(steps, "float16 overflows: {who} is what the reference computes with q @ kᵀ computed in float16, "
                    f"whose largest number is {torch.finfo(torch.float16).max:.6g}: "
                    f"{int(torch.isinf(steps['scores']).sum())} scores passed it and became inf; compute it in "
                    "float32, or scale q by 1/√d_head before the matmul", tol="float16")


# where a dropout can sit: on the attention weights, or on the output before the heads merge, before the output
# projection or after it (transformers' StarCoder2 `residual_dropout`, nanoGPT's `resid_dropout`)
DROPPED_AT = {"attention": "the attention", "x_raw": "the heads' output", "out": "the output",
              "x_rsh2": "the merged heads (before the output projection)", "x": "the output projection's output"}


def _dropout(b: Base) -> Iterator[Trial]:
    """A dropout left on, whatever its form (dropouts.drops: F.dropout, or a keep-mask drawn at random and multiplied
    in by hand, flax's and haiku's ports): the mask it drew, read from its two tensors, applied to the reference
    step its input holds."""
    from attnscope.usertrace.dropouts import drops

    for drop in drops(b.ctx.records):
        record = drop.record
        found = _dropped(b, record, drop.before)
        if found is None:
            continue
        name, after, kept = found
        multiplier = torch.where(kept != 0, after / kept.where(kept != 0, torch.ones_like(kept)), 0.0)
        zeroed = float(((after == 0) & (kept != 0)).double().mean())
        runs = "the module runs in eval() mode" if b.kind == "module" else "trace runs your function for inference"
        if drop.own:
            how = (f"line {record.line}'s own dropout (a keep-mask drawn at random, "
                   f"{'p = ' + format(drop.p, '.3g') + ', ' if math.isfinite(drop.p) else ''}{zeroed:.1%} of "
                   f"{DROPPED_AT[name]} zeroed, the rest scaled by 1/(1 − p))")
            fix = ("it is applied whatever the mode: draw it only when training (`if self.training`, flax's "
                   "`deterministic`), as F.dropout(..., training=self.training) does")
        else:
            how = (f"line {record.line}'s dropout (p = {drop.p:g}, {zeroed:.1%} of {DROPPED_AT[name]} zeroed, the rest "
                   "scaled by 1/(1 − p))")
            fix = "F.dropout's training argument defaults to True: " + (
                "pass training=self.training (or use nn.Dropout)" if b.kind == "module" else
                "pass it a training flag (training=False at inference)")
        steps = replay(b, multiplier=multiplier) if name == "attention" else replay(b, dropped={name: multiplier})
        yield Trial(steps, f"dropout is active although {runs}: {{who}} is what the reference computes with {how} "
                    f"applied to its {name}; {fix}")
    yield from _blocked_dropout(b)


def _blocked_dropout(b: Base) -> Iterator[Trial]:
    """Dropout in online softmax (lucidrains' memory-efficient attention, a flash loop in PyTorch): each block's
    exp(scores − max) dropped out, the block placed where its scores stand in the reference's (its matmul's values
    found there); the reference's attention times that multiplier, as flash-attention drops the normalized weights,
    and renormalized by the dropped weights' sum, as code that sums the dropped block does."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.flow import EXPONENTS
    from attnscope.usertrace.record import SOFTMAXES

    records = b.ctx.records
    if b.col or "attention" not in b.ref or any(r.func in SOFTMAXES for r in records):
        return
    scores, attention = b.ref["scores"], b.ref["attention"]
    multiplier, line, p = torch.ones_like(attention), None, float("nan")
    for record in records:
        if record.func != "dropout" or not record.parents:
            continue
        before = records[record.parents[0]]
        above = sorted(ancestors(before, records) | {before.index}, reverse=True)
        if torch.equal(before.tensor, record.tensor) or not any(records[i].func in EXPONENTS for i in above):
            continue
        # the nearest tensor it is made from that holds a block of the reference's scores (q · kᵀ, scaled)
        at = next((found for i in above if records[i].tensor.shape == before.tensor.shape
                   and records[i].tensor.is_floating_point()
                   and (found := _block_at(records[i].tensor.double(), scores)) is not None), None)
        if at is None:
            return
        kept, after = before.tensor.double(), record.tensor.double()
        rows, cols = at[0], at[1]
        multiplier[..., rows:rows + kept.shape[-2], cols:cols + kept.shape[-1]] = torch.where(
            kept != 0, after / kept.where(kept != 0, torch.ones_like(kept)), 0.0)
        line, p = line or record.line, float(record.details.get("p", p))
    if line is None:
        return
    said = (f"dropout is active although the module runs in eval() mode: {{who}} is what the reference computes with "
            f"line {line}'s dropout (p = {p:g}) applied to each block of its attention")
    fix = "; F.dropout's training argument defaults to True: pass training=self.training"
    yield Trial(replay(b, multiplier=multiplier), said + fix)
    dropped = attention * multiplier
    total = dropped.sum(-1, keepdim=True)
    renormed = torch.where(total > 0, multiplier / total.where(total > 0, torch.ones_like(total)), 0.0)
    yield Trial(replay(b, multiplier=renormed), said + ", the dropped weights summed as the normalizer" + fix)


def _blocks_computed(b: Base) -> torch.Tensor | None:
    """In code that calls no softmax (online softmax over blocks), the cells of the scores its blocks cover, each
    block's exp(scores − max) placed where its scores stand in the reference's; None where it covers them all, or
    a block is not placed."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.flow import EXPONENTS
    from attnscope.usertrace.record import SOFTMAXES

    records = b.ctx.records
    if b.col or "scores" not in b.ref or any(r.func in SOFTMAXES for r in records):
        return None
    scores = b.ref["scores"]
    covered = torch.zeros_like(scores, dtype=torch.bool)
    for record in records:
        if record.func not in EXPONENTS or record.tensor.dim() != scores.dim():
            continue
        above = sorted(ancestors(record, records), reverse=True)
        at = next((found for i in above if records[i].tensor.shape == record.tensor.shape
                   and records[i].tensor.is_floating_point()
                   and (found := _block_at(records[i].tensor.double(), scores)) is not None), None)
        if at is None:
            continue  # a renormalizing factor's exp (exp(m - m_new)), no block of weights
        a, c = record.tensor.shape[-2:]
        covered[..., at[0]:at[0] + a, at[1]:at[1] + c] = True
    return None if bool(covered.all()) or not bool(covered.any()) else covered


def _block_at(block: torch.Tensor, scores: torch.Tensor) -> tuple[int, int] | None:
    """Where a block of scores `[.., a, c]` stands in the reference's `[.., n_Q, n_K]`: the first offset whose values
    it holds to tolerance; None where none, or the leading axes differ."""
    from attnscope.usertrace.align import tolerance

    if block.shape[:-2] != scores.shape[:-2] or block.shape[-2] > scores.shape[-2] \
            or block.shape[-1] > scores.shape[-1] or scores.shape[-2] * scores.shape[-1] > 1 << 16:
        return None
    tol = tolerance(scores.float())
    a, c = block.shape[-2:]
    for i in range(scores.shape[-2] - a + 1):
        for j in range(scores.shape[-1] - c + 1):
            if float((scores[..., i:i + a, j:j + c] - block).abs().max()) <= tol:
                return i, j
    return None


def _dropped(b: Base, record: Record, before: Record) -> tuple[str, torch.Tensor, torch.Tensor] | None:
    """(the reference step the dropout's input holds, the dropout's output and input laid out as that step), the
    first of DROPPED_AT's steps that it equals; None where it holds none."""
    from attnscope.usertrace.align import compare, tolerance

    for name in DROPPED_AT:
        if name not in b.ref:
            continue
        step = _out(b, name) if name == "attention" else b.ref[name]
        # to the tolerance of the user's dtype (a function's reference runs in float64)
        tol = tolerance(step.to(before.tensor.dtype)) if before.tensor.is_floating_point() else None
        match = next(iter(compare(before, step, b.ctx.skip.get(name), tol=tol)), None)
        if match is None or not match.equal:
            continue
        shape = tuple(step.shape)
        after, kept = (match.layout.undo(t.double(), shape) for t in (record.tensor, before.tensor))
        if name == "attention":
            after, kept = _back_row(b, after), _back_row(b, kept)
        return name, after, kept
    return None


def _out(b: Base, name: str) -> torch.Tensor:
    """A reference step in the user's layout (the column form's own)."""
    return _back_row(b, b.ref[name])


def _back_row(b: Base, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.transpose(-1, -2) if b.col and tensor.dim() >= 2 else tensor


def _root(n: int) -> str:
    root = math.isqrt(n)
    return f"{root}" if root * root == n else f"{math.sqrt(n):.3g}"


CATALOG: tuple[Experiment, ...] = (
    Experiment("heads.split_without_permute", "heads", "heads split by a view without the transpose", _split),
    Experiment("rope.pairing", "RoPE", "the other pairing, or tables of one pairing with the other's rotation",
               _pairing),
    Experiment("rope.positions", "RoPE", "a decode step's new tokens rotated from position 0", _positions),
    # rope.fraction before rope.base: frequencies over the whole head turn as base^fraction over the rotated part
    Experiment("rope.fraction", "RoPE", "only a fraction of each head rotated (rotary_pct)", _fraction),
    Experiment("rope.base", "RoPE", "another base (rope_theta)", _base),
    Experiment("rope.not_applied", "RoPE", "queries and keys never rotated", _not_applied),
    Experiment("rope.untold", "RoPE", "RoPE the reference was not told of (--rope)", _untold),
    Experiment("rope.on_values", "RoPE", "the values rotated as the keys are", _on_values),
    Experiment("kv.swapped", "keys and values", "K and V swapped", _swapped),
    Experiment("kv.values_from_keys", "keys and values", "the values taken from the keys", _values_from_keys),
    Experiment("cache.order", "cache", "the cache joined after the new keys", _cache_order),
    Experiment("gqa.tiled", "grouped-query", "key/value heads tiled (.repeat) instead of interleaved",
               lambda b: _tiled(b, True)),
    Experiment("gqa.group_order", "grouped-query", "a grouped einsum with the query heads in the wrong order",
               lambda b: _tiled(b, False)),
    Experiment("scale.none", "scale", "scores not scaled (or 1/√d_head where --scale gives the model's own)",
               _scale_none),
    Experiment("scale.twice", "scale", "scores scaled twice", _scale_twice),
    Experiment("scale.half", "scale", "one share of a split scale left out (q · d_head^-0.25 without k's)",
               _scale_half),
    Experiment("scale.d_head", "scale", "scores divided by d_head, not √d_head", _scale_d),
    Experiment("scale.d_model", "scale", "scores divided by √d_model, not √d_head", _scale_d_model),
    Experiment("scale.n", "scale", "scores divided by another size (n_Q, n_K, n_head, d_model, d_V, ...) or its "
               "root", _scale_n),
    Experiment("scale.multiplied", "scale", "scores multiplied by √d_head", _scale_multiplied),
    Experiment("scale.other", "scale", "scores scaled by a number no size of the run gives, solved from your "
               "scores", _scale_other),
    Experiment("softcap.value", "softcap", "the scores capped at another C than the reference's", _softcap_value),
    Experiment("softcap.missing", "softcap", "the scores never capped where the reference caps them", _softcap_missing),
    Experiment("softcap.after_mask", "softcap", "the cap applied after the mask (masked scores capped to -C)",
               _softcap_after_mask),
    Experiment("softcap.form", "softcap", "tanh(s / C) without · C, or C · tanh(s) without / C, or the cap before "
               "the scale", _softcap_form),
    Experiment("softcap.untold", "softcap", "a cap of the code's own the reference was not told of (--softcap)",
               _softcap_untold),
    Experiment("float16.overflow", "precision", "q @ kᵀ in float16, past 65504", _float16),
    Experiment("alibi.sign", "ALiBi", "ALiBi's bias with its sign flipped", _alibi_sign),
    Experiment("alibi.slopes", "ALiBi", "other slopes than 2^(-8 h / n_head)", _alibi_slopes),
    Experiment("alibi.query_positions", "ALiBi", "a bias symmetric in i and j", _alibi_queries),
    Experiment("t5.transposed", "T5 bias", "the position bias transposed", _t5_transposed),
    Experiment("t5.after_softmax", "T5 bias", "the position bias added after the softmax", _t5_after_softmax),
    Experiment("mask.polarity", "mask", "the mask read the other way round", _polarity),
    Experiment("mask.after_softmax", "mask", "the mask applied after the softmax", _after_softmax),
    Experiment("mask.multiplied", "mask", "the scores multiplied by the mask", lambda b: _zero(b, True)),
    Experiment("mask.filled_with_0", "mask", "masked scores filled with 0", lambda b: _zero(b, False)),
    Experiment("mask.off_by_one", "mask", "the causal band one key wider or narrower", _off_by_one),
    Experiment("mask.no_window", "mask", "the rule's sliding window left out (its causal mask kept)", _no_window),
    Experiment("mask.window_untold", "mask", "a window of the code's own the reference was not told of (--window)",
               _window_untold),
    Experiment("mask.on_queries", "mask", "a key-padding mask applied on the queries", _on_queries),
    Experiment("mask.upper_left", "mask", "is_causal=True (upper-left) in a decode step", _upper_left),
    Experiment("softmax.axis", "softmax", "the softmax over another axis than the keys", _softmax_axis),
    Experiment("heads.merge_without_transpose", "heads", "heads merged by a view before the permute", _merge),
    Experiment("heads.merge_wrong_permute", "heads", "heads merged after another permute than (0, 2, 1, 3)",
               _merge_permuted),
    Experiment("dropout.left_on", "dropout", "dropout active in eval() mode", _dropout),
)
