"""Masks of the wrong pattern, and ALiBi, told by the numbers (diagnose.py asks them before the mask is called
inverted or not applied).

A wrong mask is found in the user's own masked scores: the tensor their code made by setting cells very negative
(`-inf`, `-1e9`, `finfo.min`), its other cells the reference's scores. That tensor need not be the one lined up
with `masked_scores`: where the mask is applied on the line after the scores, the line-up pairs `masked_scores`
with the unmasked scores line (alignsteps.py), so every tensor of the scores' shape is read here. The user's allowed
set is compared with the reference's cell by cell, and the cells that differ named by where they lie, relative
to the reference's own diagonal (query i's last key, lower-right aligned or not):

- above the diagonal as well: a causal band off by one (`tril(diagonal=1)`), or more;
- the diagonal forbidden: `tril(diagonal=-1)`, a query that may not see itself;
- everything above the diagonal allowed and below forbidden: an anticausal mask (`triu`);
- beyond the window allowed: a sliding window (Mistral's) forgotten, or a wider one;
- whole query rows forbidden where the reference forbids key columns: a key-padding mask applied on queries.

ALiBi: the user's scores are the reference's plus `m_h · j` per head (BLOOM's form, or `-m_h · (i - j)`, the
same after the softmax); the slopes are fitted and compared with ALiBi's `2^(-8 h / n_head)` (attnscope.variants.alibi).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnscope.usertrace.align import VERY_NEGATIVE
from attnscope.usertrace.diagnosis import Context, Diagnosis, close, label_of

if TYPE_CHECKING:
    from attnscope.usertrace.align import Match
    from attnscope.usertrace.record import Record


def wrong_mask(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    """A whole cause (looks through every record): the user's masked scores forbid other cells than the
    reference's."""
    if step not in ("masked_scores", "attention") or "masked_scores" not in ctx.reference:
        return None
    reference = ctx.reference["masked_scores"].double()
    scores = ctx.reference["scores"].double() if "scores" in ctx.reference else None
    allowed = ~torch.isneginf(reference)
    for record in reversed(ctx.records):
        user = _masked_scores_of(record, reference.shape, scores, allowed)
        if user is None:
            continue
        mine = user > VERY_NEGATIVE
        if bool(torch.equal(mine, allowed)):
            continue
        if bool(torch.equal(mine, ~allowed)):
            return Diagnosis(f"the mask is read the other way round: {label_of(record)} masks exactly the cells the "
                             f"reference allows; True is read as masked out (nn.MultiheadAttention's attn_mask "
                             "convention) where the reference reads it as may attend (the tutorials' "
                             "masked_fill(mask == 0, -1e9), F.scaled_dot_product_attention's)", record)
        other = "A" if ctx.comparing else "the reference"
        return Diagnosis(f"{label_of(record)} masks other cells than {other}: "
                         f"{_say(mine, allowed).replace('the reference', other)}", record)
    return None


def _masked_scores_of(record: Record, shape: torch.Size, scores: torch.Tensor | None,
                      allowed: torch.Tensor) -> torch.Tensor | None:
    """The record as masked scores in the reference's shape: some cells very negative, the others the reference's
    scores (where those are known); else None."""
    tensor = record.tensor
    if not tensor.is_floating_point() or tensor.dim() != len(shape) or tuple(tensor.shape[-2:]) != tuple(shape[-2:]):
        return None
    try:
        user = tensor.double().expand(shape)
    except RuntimeError:
        return None
    kept = user > VERY_NEGATIVE
    if bool(kept.all()) or not bool(kept.any()):
        return None
    if scores is not None and not close(torch.where(kept, user, 0.0), torch.where(kept, scores, 0.0)):
        return None
    return user


def _say(mine: torch.Tensor, allowed: torch.Tensor) -> str:
    """Which cells differ, named by where they lie against the reference's diagonal and band."""
    n_Q, n_K = allowed.shape[-2:]
    i = torch.arange(n_Q)[:, None]
    j = torch.arange(n_K)[None, :]
    extra, hidden = mine & ~allowed, allowed & ~mine  # the user allows, the reference forbids; and the other way
    n_extra, n_hidden = int(extra.sum()), int(hidden.sum())
    counts = f"{n_extra} cells the reference forbids are allowed, {n_hidden} it allows are masked"
    # key padding: the reference forbids whole key columns (alike in every row), the user whole query rows
    columns = allowed.all(-2, keepdim=True).expand_as(allowed)
    # allowed: [.., n_Q, n_K] -> [.., n_K, n_Q]
    if bool(torch.equal(columns, allowed)) and bool(torch.equal(mine, allowed.transpose(-1, -2))):
        return (f"it masks whole query rows where the reference masks key columns: a key-padding mask applied on "
                f"the queries ({counts}); a padded key is one no query may see, so the mask is [n_batch, 1, 1, n_K] "
                "(`mask[:, None, None, :]`), not [n_batch, 1, n_K, 1]")
    # a mask of key padding alone: the padded keys (no query may see them) masked, the causal or window rule not
    keys = allowed.any(-2, keepdim=True).expand_as(allowed)
    if not bool(keys.all()) and not bool(torch.equal(keys, allowed)) and bool(torch.equal(mine, keys)):
        return (f"only the key padding is applied: it masks the padded keys and nothing else ({counts}), where the "
                "reference also masks by position (its causal or window rule, --causal/--window); the rule is "
                "missing: mask the scores with it as well (`tril(ones(n_Q, n_K))`, or is_causal=True)")
    if _two_sided(allowed, keys):  # a window on both sides (ModernBERT's local layers): by distance, not diagonal
        return counts + _distances(extra, hidden, (i - j).abs())
    reach = _diagonal(allowed)
    if reach is None:
        return counts + _regions(extra, hidden, None, i, j)
    rel = (j - i - reach).expand_as(allowed)  # 0 on the reference's diagonal, > 0 above it (the future)
    window = _window(allowed, rel)
    above, diagonal = rel > 0, rel == 0
    if bool(torch.equal(mine, (rel >= 0) & (True if window is None else rel < window))):
        return (f"an anticausal mask: it lets each query see itself and the keys after it and masks those before "
                f"({counts}); `triu` where a causal mask is `tril` (True = may attend on and below the diagonal)")
    if n_hidden == 0 and bool((extra <= above).all()):
        past = int(rel[extra].max())
        seen = "the next key" if past == 1 else f"the next {past} keys"
        return (f"the causal band is off by {past}: each query also sees {seen} after it, above the "
                f"diagonal ({counts}); `tril(..., diagonal={past})` where a causal mask is `tril(...)`, diagonal=0"
                + (" (or `triu(..., diagonal=1)` of the masked cells, not `diagonal=0`)" if past == 1 else ""))
    if n_extra == 0 and bool(torch.equal(hidden, diagonal & allowed)):
        return (f"it masks the diagonal: no query may see its own key ({counts}; a first query then sees no key "
                "at all, and its softmax is NaN); `tril(..., diagonal=-1)` (or `triu(..., diagonal=0)` of the "
                "masked cells) where a causal mask is `tril(...)`, diagonal=0")
    if window is not None and n_hidden == 0 and bool((extra <= (rel <= -window)).all()):
        if bool(torch.equal(mine, rel <= 0)):
            return (f"the sliding window is missing: each query sees every earlier key, where the reference's "
                    f"window of {window} masks the keys {window} or more positions back ({counts}); a Mistral-style "
                    f"band is `tril(...)` & `triu(..., diagonal=-{window - 1})`")
        wider = _window(mine, rel)
        return (f"the sliding window is wider than the reference's {window}" + (f": {wider}" if wider else "")
                + f" ({counts}); query i sees key j when j ≤ i and i − j < window")
    if window is not None and n_extra == 0 and bool((hidden <= (rel < 0)).all()):
        narrower = _window(mine, rel)
        return (f"the sliding window is narrower than the reference's {window}" + (f": {narrower}" if narrower else "")
                + f" ({counts}); query i sees key j when j ≤ i and i − j < window")
    return counts + _regions(extra, hidden, rel, i, j) + _own_pattern(hidden, n_extra)


def _own_pattern(hidden: torch.Tensor, n_extra: int) -> str:
    """Where the code only masks more than the reference, the same cells in every sequence and head (Llama 4's
    chunks under --causal alone, blocks, a pattern of its own): how to describe that pattern; else nothing."""
    n_Q, n_K = hidden.shape[-2:]
    cells = hidden.reshape(-1, n_Q, n_K)
    if n_extra or not bool(cells.any()) or not bool((cells == cells[:1]).all()):
        return ""
    return ("; your code masks these by itself, the same cells in every sequence and head (chunks, blocks, a pattern "
            "of its own that no --causal or --window says): where they are your model's, describe them with --mask "
            "FILE, [n_Q, n_K], True = may attend, the rule's cells and yours together (Llama 4's chunked local "
            "attention: `(j <= i) & (i // C == j // C)`)")


def _two_sided(allowed: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the reference's mask is a window on both sides of the diagonal, |i − j| <= w (beside key padding): the
    same read by rows as by columns, once the padded keys' columns and rows are left out, with keys masked both
    after and before some query."""
    n_Q, n_K = allowed.shape[-2:]
    if n_Q != n_K:
        return False
    rule = allowed | ~keys | ~keys.transpose(-1, -2)
    rel = torch.arange(n_K)[None, :] - torch.arange(n_Q)[:, None]
    return bool(torch.equal(rule, rule.transpose(-1, -2))) and bool((~rule & (rel > 0)).any())


def _distances(extra: torch.Tensor, hidden: torch.Tensor, distance: torch.Tensor) -> str:
    """The differing cells by their distance from the diagonal, |i − j|."""
    parts = []
    for what, cells in (("allowed", extra), ("masked", hidden)):
        if bool(cells.any()):
            far = distance.expand_as(cells)[cells]
            counts = [f"{int((far == d).sum())} at |i − j| = {int(d)}" for d in far.unique()]
            parts.append(f"{what}: {', '.join(counts)}")
    return f" ({'; '.join(parts)})"


def _diagonal(allowed: torch.Tensor) -> int | None:
    """The reference's diagonal: the offset d such that no allowed cell has j - i > d, and some has j - i = d;
    None when the reference's mask is not causal (it allows the last key to the first query)."""
    n_Q, n_K = allowed.shape[-2:]
    rel = torch.arange(n_K)[None, :] - torch.arange(n_Q)[:, None]
    any_allowed = allowed.reshape(-1, n_Q, n_K).any(0)  # [.., n_Q, n_K] -> [n_Q, n_K]
    if not bool(any_allowed.any()):
        return None
    reach = int(rel[any_allowed].max())
    return reach if reach < n_K - 1 else None


def _window(allowed: torch.Tensor, rel: torch.Tensor) -> int | None:
    """The width W of a band (the cells with -W < rel ≤ 0 allowed) where the mask is one with W < n_K, else None."""
    on_or_below = allowed & (rel <= 0)
    if not bool(on_or_below.any()):
        return None
    width = int((-rel[on_or_below]).max()) + 1
    band = (rel <= 0) & (rel > -width)
    if bool(torch.equal(on_or_below, band)) and bool(((rel <= -width) & (rel > -rel.shape[-1])).any()):
        return width
    return None


def _regions(extra: torch.Tensor, hidden: torch.Tensor, rel: torch.Tensor | None, i: torch.Tensor,
             j: torch.Tensor) -> str:
    """The differing cells by region: above the diagonal, on it, below it, and whole rows."""
    parts = []
    for what, cells in (("allowed", extra), ("masked", hidden)):
        if not bool(cells.any()):
            continue
        if rel is None:
            parts.append(f"{what} at {int(cells.sum())} cells")
            continue
        where = [f"{int((cells & r).sum())} {name}" for name, r in
                 (("above the diagonal", rel > 0), ("on the diagonal", rel == 0), ("below it", rel < 0))
                 if bool((cells & r).any())]
        parts.append(f"{what}: {', '.join(where)}")
    rows = int((hidden.all(-1) & hidden.any(-1)).sum())
    whole = f"; {rows} whole query rows masked" if rows else ""
    return f" ({'; '.join(parts)}{whole})"


# --- ALiBi ----------------------------------------------------------------------------------------------------


def alibi(step: str, ctx: Context, near: Match | None) -> Diagnosis | None:
    """The user's scores (or softmax) are the reference's plus a linear bias in the key position per head."""
    from attnscope.variants import alibi as alibi_math

    if step not in ("scores", "biased_scores", "masked_scores", "attention") or step not in ctx.reference:
        return None
    reference = ctx.reference[step].double()
    if reference.dim() < 3:
        return None
    n_head = reference.shape[-3]
    # the biased scores are the first tensor that adds the bias (the masked ones after it add it too)
    plain: Record | None = None
    for record in (ctx.records if step == "biased_scores" else reversed(ctx.records)):
        if tuple(record.tensor.shape) != tuple(reference.shape) or not record.tensor.is_floating_point():
            continue
        slopes = fit_slopes(record.tensor.double(), reference, step == "attention")
        if slopes is None:
            continue
        told = ctx.spec is not None and ctx.spec.alibi
        standard = alibi_math.slopes(n_head).double()
        if told and step != "scores":  # the fit is the user's slopes less the reference's own (its scores: none)
            slopes = slopes + standard
            if bool((slopes.abs() < 1e-6).all()):  # no bias at all: the scores before it
                plain = plain or record
                continue
        said = ", ".join(f"{m:.4g}" for m in slopes.tolist())
        if not told and torch.allclose(slopes, standard, rtol=1e-3, atol=1e-6):
            return Diagnosis(f"{label_of(record)} adds ALiBi's bias to the {step}: m_h · (j − i) per head with "
                             f"ALiBi's slopes ({said}: 2^(-8 h / n_head)), which the reference was not told of; "
                             "describe it with --alibi (the steps before it line up)", record)
        expected = ", ".join(f"{m:.4g}" for m in standard.tolist())
        masked = _mask_too(record, ctx) if told else None
        if masked is not None:  # the slopes fit on the cells the code's own mask keeps, which are not the reference's
            return Diagnosis(f"{label_of(record)} is not the reference's {step}: on the cells your code keeps it "
                             f"holds a linear bias m_h · (j − i) with slopes {said} (ALiBi's for {n_head} heads: "
                             f"{expected}), and its mask is not the reference's ({masked}); two deviations at once, "
                             f"which no one mistake of trace's catalog reproduces: {step} is where your code and the "
                             "reference part", record)
        return Diagnosis(f"{label_of(record)} adds a linear position bias m_h · (j − i) to the {step} with slopes "
                         f"{said}, which are not ALiBi's for {n_head} heads ({expected}: 2^(-8 h / n_head)); ALiBi is "
                         "wrong" + ("" if told else " (and the reference adds none: --alibi adds ALiBi's)"), record)
    if plain is not None:
        added = _bias_added_after(plain, ctx.records)
        if added is not None:  # the code does add a bias, later: never said missing
            masked = _mask_too(plain, ctx)
            return Diagnosis(f"{label_of(plain)} is the reference's {step} less ALiBi's bias; your code adds a bias "
                             f"of its own after it ({label_of(added)}), and the sum is not the reference's {step}"
                             f"{_cells_apart(added.tensor, ctx.reference[step])}"
                             + (f", and your mask is not the reference's ({masked})" if masked else "")
                             + "; no one mistake of trace's catalog, rerun on the reference, gives it back: "
                             f"{step} is where your code and the reference part", added)
        return Diagnosis(f"{label_of(plain)} adds no position bias: it is the reference's {step} less ALiBi's bias "
                         "−m_h · (i − j), which --alibi told the reference to add; drop --alibi, or add ALiBi", plain)
    return None


ADDS = ("add", "add_", "__add__", "__radd__", "__iadd__", "baddbmm")


def _bias_added_after(plain: Record, records: list[Record]) -> Record | None:
    """The first add after `plain` (the code's scores before any bias) of a tensor made from it and one that is
    not, of its shape, whose other operand is no constant: the code's own bias; None where none."""
    from attnscope.usertrace.align import ancestors

    for record in records[plain.index + 1:]:
        if record.func not in ADDS or tuple(record.tensor.shape) != tuple(plain.tensor.shape) \
                or plain.index not in ancestors(record, records) | {record.index}:
            continue
        others = [records[v] for k, v in record.args if k == "rec"
                  and plain.index not in ancestors(records[v], records) | {v}]
        if any(o.tensor.is_floating_point() and o.tensor.numel() > 1 and float(o.tensor.double().std()) > 0
               for o in others):
            return record
    return None


def _cells_apart(mine: torch.Tensor, reference: torch.Tensor) -> str:
    """Where `mine` and the reference's step part, against the diagonal: ' (it differs at N cells: ...)'."""
    if tuple(mine.shape) != tuple(reference.shape):
        return ""
    a, b = mine.double(), reference.double()
    apart = ~torch.isclose(a, b, rtol=1e-4, atol=1e-4) & ~(torch.isinf(a) & torch.isinf(b) & (a.sign() == b.sign()))
    if not bool(apart.any()):
        return ""
    n_Q, n_K = apart.shape[-2:]
    rel = (torch.arange(n_K)[None, :] - torch.arange(n_Q)[:, None] - (n_K - n_Q)).expand_as(apart)
    where = [f"{int((apart & r).sum())} {name}" for name, r in
             (("cells above the diagonal", rel > 0), ("on it", rel == 0), ("below it", rel < 0))
             if bool((apart & r).any())]
    return f" (they differ at {', '.join(where)})"


def _mask_too(record: Record, ctx: Context) -> str | None:
    """Where the pattern the code makes from `record` keeps other cells than the reference's pattern: those cells,
    said as a wrong mask is (_say); None where they keep the same cells (or no pattern is found)."""
    from attnscope.usertrace.align import ancestors

    reference = ctx.reference["attention"] if "attention" in ctx.reference else None
    if reference is None:
        return None
    shape = tuple(reference.shape)
    softmaxes = [r.index for r in ctx.records[record.index + 1:] if "softmax" in r.func
                 and record.index in ancestors(r, ctx.records)]
    if not softmaxes:
        return None
    patterns = [r for r in ctx.records[softmaxes[0]:] if tuple(r.tensor.shape) == shape and r.tensor.is_floating_point()
                and (r.index == softmaxes[0] or softmaxes[0] in ancestors(r, ctx.records))
                and bool((r.tensor >= 0).all())]
    if not patterns:
        return None
    mine, allowed = patterns[-1].tensor > 0, reference > 0
    if bool(torch.equal(mine, allowed)):
        return None
    return _say(mine, allowed)


def fit_slopes(user: torch.Tensor, reference: torch.Tensor, softmax: bool) -> torch.Tensor | None:
    """Per head, the slope m of user − reference = m · j + c(row), over the cells both keep; None where no such
    bias (with some m ≠ 0) fits."""
    if softmax:
        usable = (user > 0) & (reference > 0)
        difference = torch.where(usable, user.clamp_min(1e-300).log() - reference.clamp_min(1e-300).log(), 0.0)
    else:
        usable = (user > VERY_NEGATIVE) & (reference > VERY_NEGATIVE) & torch.isfinite(user) & torch.isfinite(reference)
        difference = torch.where(usable, user - reference, 0.0)
    if not bool(usable.any()):
        return None
    j = torch.arange(user.shape[-1], dtype=torch.float64).expand_as(user)
    count = usable.sum(-1, keepdim=True).clamp_min(1)
    jc = torch.where(usable, j - (j * usable).sum(-1, keepdim=True) / count, 0.0)  # centred per row
    dc = torch.where(usable, difference - difference.sum(-1, keepdim=True) / count, 0.0)
    heads = user.dim() - 3
    dims = [d for d in range(user.dim()) if d != heads]
    denominator = (jc * jc).sum(dims)
    if bool((denominator == 0).any()):
        return None
    slopes = (jc * dc).sum(dims) / denominator  # [n_head]
    if bool((slopes.abs() < 1e-6).all()):
        return None
    shape = [1] * user.dim()
    shape[heads] = -1
    residual = (dc - jc * slopes.view(shape)).abs().max()  # slopes [n_head] along the head axis
    scale = float(dc.abs().max())
    return slopes if float(residual) <= 1e-4 * max(scale, 1.0) else None
