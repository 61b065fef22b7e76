"""The catalog's mask mistakes: not applied, polarity, after the softmax, multiplied or filled with 0, the causal
band off by one, a window left out or untold, key padding on the queries, upper-left is_causal in a decode step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch

from attnscope.usertrace.rerun import Base, Reproduced, replay

if TYPE_CHECKING:
    from attnscope.spec import WindowSide
    from attnscope.usertrace.record import Record
from attnscope.usertrace.trialreads import blocks_computed, has_mask
from attnscope.usertrace.trials import Trial


def trials_polarity(b: Base) -> Iterator[Trial]:
    if has_mask(b):
        assert b.allowed is not None
        yield Trial(replay(b, allowed=~b.allowed), "the mask is read the other way round: {who} is what the "
                    "reference computes with the mask inverted, every allowed cell masked and every masked one "
                    "allowed: True read as masked out where it means may attend, or the reverse "
                    "(nn.MultiheadAttention's attn_mask convention against the tutorials' "
                    "masked_fill(mask == 0, -1e9) and F.scaled_dot_product_attention's)")
        apart = _padding_apart(b)
        if apart is not None:  # the padding read the other way round beside a rule of the code's own (causalflag.py)
            ruled, keys = apart
            yield Trial(replay(b, allowed=ruled & ~keys), "the key padding is read the other way round: {who} is what "
                        "the reference computes with the padding inverted beside the causal or window rule, every "
                        "padded key seen and every other masked: True read as masked out where it means may attend, "
                        "or the reverse (fairseq's key_padding_mask, 1 = a pad, against transformers' "
                        "attention_mask, 1 = a real token)")
            # the rule read the other way round, the key padding beside it as it should be (`tril(ones(T, T, bool))`
            # handed to nn.MultiheadAttention's attn_mask, True = not allowed, beside a key_padding_mask it applies
            # well): the rule's complement on the keys left unpadded
            yield Trial(replay(b, allowed=~ruled & keys), "the causal or window rule is read "
                        "the other way round, the key padding beside it as it should be: {who} is what the "
                        "reference computes with the rule inverted (each query seeing the keys it should not, a "
                        "query that sees none left without any) and the padded keys still masked: a boolean "
                        "`tril(ones(n_Q, n_K))` handed where True means masked out (nn.MultiheadAttention's "
                        "attn_mask), or the reverse; hand it the rule's complement there (a causal one's is "
                        "`triu(ones(n_Q, n_K, dtype=bool), diagonal=1)`)")


def trials_unmasked(b: Base) -> Iterator[Trial]:
    """The mask left out altogether: the reference's scores softmaxed as they are (code that builds or slices its
    causal mask and never applies it, CodeGen's `torch.where(causal_mask, ...)` left out; a mask argument it never
    reads)."""
    if has_mask(b):
        assert b.allowed is not None
        yield Trial(replay(b, allowed=None), f"the mask is not applied: {{who}} is what the reference computes with "
                    f"no mask at all, the {int((~b.allowed).sum())} positions the mask forbids keeping their scores; "
                    "apply it to the scores before the softmax (masked_fill(~mask, -inf))")


def _padding_apart(b: Base) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The reference's mask as the causal or window rule and key padding (a --mask file's, or trace's) apart, each
    as large as the mask (True = may attend), where it is their two together and some key is padded; None where it
    is not (rule_and_keys)."""
    assert b.allowed is not None
    rule, keys = rule_and_keys(b)
    if rule is None or keys is None or bool(keys.all()):
        return None
    return rule.expand_as(b.allowed), keys.expand_as(b.allowed)


def rule_and_keys(b: Base) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The reference's causal or window rule [n_Q, n_K] and the keys its mask leaves unpadded [.., 1, n_K], where
    its mask is the two together; (None, None) otherwise."""
    rule = _rule(b)
    if rule is None or b.allowed is None or rule.shape != b.allowed.shape[-2:]:
        return None, None
    keys = (b.allowed | ~rule).all(-2, keepdim=True)  # a key the rule lets some query see and none may see
    if not bool(torch.equal((rule & keys).expand_as(b.allowed), b.allowed)):
        return None, None
    return rule, keys


def trials_after_softmax(b: Base) -> Iterator[Trial]:
    if not has_mask(b):
        return
    assert b.allowed is not None
    # key padding before the softmax, the causal or window rule after: code that applies its two masks apart (CLIP's
    # attention_mask, then causal_attention_mask)
    splits: list[tuple[torch.Tensor, torch.Tensor | None]] = [(b.allowed, None)]
    apart = _padding_apart(b)
    if apart is not None:
        splits.append(apart)
    for after, before in splits:
        part = "the mask" if before is None else "the causal or window rule (the key padding applied before it)"
        yield Trial(replay(b, mask="after", allowed=after, before=before), f"{part} is applied after the softmax: "
                    "{who} is what the reference computes with the unmasked scores softmaxed and the masked weights "
                    "then set to 0, so each row no longer sums to 1 and the allowed keys keep the weight the masked "
                    "ones took from them; mask the scores (masked_fill(~mask, -inf)) before the softmax")
        # the masked weights filled after the softmax with a finite number (GPTBigCode's torch.where(mask, w,
        # finfo.min) moved below it): the same numbers as the -inf added, one rerun, the code's own op in the words
        minus_inf = replay(b, mask="added after", allowed=after, before=before)
        yield Trial(minus_inf, f"{part} is applied after the softmax: {{who}} is what the reference computes with the "
                    "unmasked scores softmaxed and the masked weights then filled with a very negative number, as your "
                    "code fills them, so the output is inf or NaN; fill the scores before the softmax",
                    fits=_filled_after)
        yield Trial(minus_inf, f"{part} is added after the softmax: "
                    "{who} is what the reference computes with the unmasked scores softmaxed and the additive mask "
                    "(0 / -inf) then added to the weights, so every masked weight is -inf and the output NaN; add the "
                    "mask to the scores before the softmax")
    added = _finite_mask(b)
    if added is not None:  # a --mask file of BERT's −10000, added as it is: the weights −10000 where masked
        yield Trial(replay(b, allowed=None, after_softmax=added), "the mask is added after the softmax: {who} is what "
                    "the reference computes with the unmasked scores softmaxed and the additive mask then added to "
                    "the weights, so every masked weight is very negative; add the mask to the scores before the "
                    "softmax")


def _filled_after(b: Base, r: Reproduced) -> bool:
    """Whether the code fills some of its softmax's weights with a very negative number (`torch.where(mask, w,
    finfo.min)`, `masked_fill`), not adds a mask to them."""
    from attnscope.usertrace.align import VERY_NEGATIVE
    from attnscope.usertrace.record import SOFTMAXES

    records = b.ctx.records
    return any(rec.func in ("where", "masked_fill", "masked_fill_") and rec.tensor.is_floating_point()
               and any(0 <= i < len(records) and records[i].func in SOFTMAXES for i in rec.parents)
               and bool((rec.tensor <= VERY_NEGATIVE).any()) for rec in records)


def _finite_mask(b: Base) -> torch.Tensor | None:
    """The additive mask the reference's masked scores hold, where it is finite (a --mask file of BERT's −10000, the
    code's own convention): masked scores − scores, 0 where the mask allows; None where it masks with −inf."""
    if b.allowed is None or "scores" not in b.ref or "masked_scores" not in b.ref or b.softcap is not None:
        return None
    masked, scores = b.ref["masked_scores"], b.ref["scores"]
    if masked.shape != scores.shape or not bool(torch.isfinite(masked).all()):
        return None
    return torch.where(b.allowed, 0.0, masked - scores)


def trials_zero(b: Base, multiplied: bool) -> Iterator[Trial]:
    if not has_mask(b):
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
    from attnscope.usertrace.masking import two_valued

    return tensor.shape[-2:] == pattern and two_valued(tensor)


def trials_off_by_one(b: Base) -> Iterator[Trial]:
    """The band one key wider or narrower at its right edge (a causal `tril` of diagonal 1 or -1), at its left edge
    (a sliding window of W + 1 or W - 1 keys, `triu(diagonal=-W)`), or at both (a bidirectional window written with
    `<` for `<=`); each run only where it changes the mask."""
    if not has_mask(b):
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
    if band is None:  # a pattern the causal rule cuts (Llama 4's chunks, a --mask file's): its edge, its chunks moved
        from attnscope.usertrace.maskblocks import changes as cut

        changes += cut(allowed)
    computed = blocks_computed(b)
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


def trials_on_queries(b: Base) -> Iterator[Trial]:
    if not has_mask(b) or b.n_Q != b.n_K:
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


def _band_moved(b: Base) -> Iterator[Trial]:
    """A sliding window's band (a causal rule with a left edge) aligned to the other corner: the queries' positions
    taken as 0..n_Q - 1 where they come after n_K - n_Q earlier keys (a window mask built from `arange(q_len)` in a
    decode step, where its positions are cache_position's), or the reverse; the key padding the reference holds
    kept. The causal rule alone is the caller's trial (trials_upper_left)."""
    from attnscope import masks
    from attnscope.spec import AttentionSpec

    spec = b.ctx.spec
    rule, keys = rule_and_keys(b)
    if spec is None or spec.window is None or spec.window_side != "left" or rule is None or keys is None \
            or b.allowed is None:
        return
    align = spec.causal or "upper-left"
    other = "upper-left" if align == "lower-right" else "lower-right"
    moved, _ = masks.structural(AttentionSpec(causal=other, window=spec.window), b.n_Q, b.n_K)
    if moved is None or bool(torch.equal(moved, rule)):
        return
    shift = b.n_K - b.n_Q
    if other == "upper-left":
        where = "in a decode step" if b.n_cache else f"where the {b.n_Q} queries are the last of {b.n_K} keys"
        words = (f"the sliding window is aligned upper-left {where}: {{who}} is what the reference computes where "
                 f"query i sees keys i − {spec.window - 1} to i, but the {b.n_Q} new queries come after {shift} "
                 f"earlier keys, so query i sees keys {shift} + i − {spec.window - 1} to {shift} + i (lower-right): "
                 "the mask built from the new queries' own indices (arange(n_Q)) where their positions are "
                 "(cache_position, n_K − n_Q + arange(n_Q))")
    else:
        words = (f"the sliding window is aligned lower-right where --causal upper-left asks for the top-left corner: "
                 f"{{who}} is what the reference computes where query i sees keys up to {shift} + i, where upper-left "
                 "query i sees keys up to i; --causal lower-right if that alignment is meant")
    yield Trial(replay(b, allowed=(moved & keys).expand_as(b.allowed)), words)


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


def trials_no_window(b: Base) -> Iterator[Trial]:
    """The rule's window left out (a causal one's causal mask kept): code that forgets the sliding window."""
    spec = b.ctx.spec
    if spec is None or spec.window is None or not has_mask(b):
        return
    assert b.allowed is not None
    side, w = spec.window_side, spec.window
    windowed = _window_rule(b, w, side, spec.causal)
    if windowed is None:
        return
    without = _window_rule(b, None, "left", spec.causal if side == "left" else None)
    freed = ~windowed if without is None else without & ~windowed  # the cells the window alone forbids
    _, keys = rule_and_keys(b)
    if keys is not None:  # key padding beside the rule (trace's, or a --mask file's): the padded keys kept
        freed = freed & keys
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


def trials_window_untold(b: Base) -> Iterator[Trial]:
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


def trials_upper_left(b: Base) -> Iterator[Trial]:
    """The causal mask aligned to the other corner where n_Q ≠ n_K: upper-left (`is_causal=True`) where the
    reference's is lower-right (a decode step, or --causal lower-right), or lower-right where --causal upper-left
    asks for the top-left corner; a key padding the reference holds kept."""
    if not has_mask(b) or b.n_Q == b.n_K:
        return
    assert b.allowed is not None
    yield from _band_moved(b)
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
