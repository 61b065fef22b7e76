"""The catalog's position-bias and softcap mistakes: ALiBi's sign, slopes and query positions; T5's bias
transposed or after the softmax; the softcap's value, form and place, missing or untold."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from attnscope.usertrace.rerun import Base, replay
from attnscope.usertrace.trialreads import back_row, has_mask, user_out
from attnscope.usertrace.trials import Trial


def _alibi_parts(b: Base) -> tuple[torch.Tensor, int, bool] | None:
    """The reference's ALiBi slopes, the position of query 0, and whether it is written symmetric, where it adds ALiBi
    (--alibi, or a --position-bias file that is ALiBi with its own slopes: _filed_alibi)."""
    from attnscope.variants import alibi

    spec = b.ctx.spec
    if spec is None or b.q.dim() < 3 or b.bias is None:
        return None
    n_head = b.q.shape[-3]
    slopes = alibi.slopes(n_head).double()
    if spec.alibi and "alibi_bias" in b.ref:
        return slopes, b.n_K - b.n_Q, False
    filed = _filed_alibi(b, slopes)
    return None if filed is None else (slopes, b.n_K - b.n_Q, filed)


def _filed_alibi(b: Base, slopes: torch.Tensor) -> bool | None:
    """Whether the --position-bias file the reference adds is ALiBi written symmetric, −m_h · |i − j| (JinaBERT's
    and MosaicBERT's bidirectional form, for which --alibi has no word), with ALiBi's slopes: True; False where it is
    −m_h · (i − j); None where it is neither (a bias of its own)."""
    spec = b.ctx.spec
    if spec is None or spec.position_bias is None or b.bias is None or b.bias.shape[-1] != b.n_K:
        return None
    held = b.bias.double().reshape(-1, *b.bias.shape[-2:])
    if held.shape[0] != slopes.numel() and held.shape[0] % slopes.numel():
        return None
    offset = b.n_K - b.n_Q
    for symmetric in (True, False):
        made = _alibi_bias(b, slopes, offset, symmetric).to(held.dtype)
        if made.shape == held.shape[-3:] or held.shape[0] % made.shape[0] == 0:
            tiled = made.repeat(held.shape[0] // made.shape[0], 1, 1)
            if tiled.shape == held.shape and torch.allclose(tiled, held, atol=1e-5 * max(1.0, float(made.abs().max()))):
                return symmetric
    return None


def _alibi_bias(b: Base, slopes: torch.Tensor, offset: int, symmetric: bool = False) -> torch.Tensor:
    i = torch.arange(b.n_Q, dtype=torch.float64)[:, None] + offset
    j = torch.arange(b.n_K, dtype=torch.float64)[None, :]
    distance = (i - j).abs() if symmetric else i - j
    return -slopes[:, None, None] * distance  # [n_head, n_Q, n_K]


def trials_alibi_sign(b: Base) -> Iterator[Trial]:
    parts = _alibi_parts(b)
    if parts is not None:
        assert b.bias is not None
        yield Trial(replay(b, bias=-b.bias), "ALiBi's sign is flipped: {who} is what the reference computes with the "
                    "bias +m_h · (i − j) added where ALiBi adds −m_h · (i − j): distant keys gain weight instead of "
                    "losing it; the slopes are positive and the bias m_h · (j − i) (BLOOM's m_h · j)")


def trials_alibi_slopes(b: Base) -> Iterator[Trial]:
    parts = _alibi_parts(b)
    if parts is None:
        return
    slopes, offset, symmetric = parts
    n_head = slopes.numel()
    said = ", ".join(f"{m:.4g}" for m in slopes.tolist())
    pow2 = n_head & (n_head - 1) == 0
    others = [("in reverse head order", slopes.flip(0)),
              ("2^(-8 h / n_head) counted from h = 0", torch.tensor([2 ** (-8 * h / n_head) for h in range(n_head)],
                                                                      dtype=torch.float64)),
              *([] if pow2 else [(f"2^(-8 h / n_head), h = 1 to {n_head}: the rule for a power of 2 heads",
                                  torch.tensor([2 ** (-8 * (h + 1) / n_head) for h in range(n_head)],
                                               dtype=torch.float64))]),
              ("2^(-h), without the 8 / n_head", torch.tensor([2.0 ** -(h + 1) for h in range(n_head)],
                                                               dtype=torch.float64)),
              ("all 1", torch.ones(n_head, dtype=torch.float64))]
    for how, m in [*others, ("fitted from your scores", None if symmetric else _fit(b, offset))]:
        if m is None or torch.allclose(m, slopes):
            continue
        mine = ", ".join(f"{x:.4g}" for x in m.tolist())
        bias = _alibi_bias(b, m, offset, symmetric).to(b.bias.dtype if b.bias is not None else torch.float64)
        yield Trial(replay(b, bias=bias), f"ALiBi's slopes are wrong: {{who}} is what the "
                    f"reference computes with slopes {mine} ({how}), which are not ALiBi's for {n_head} heads "
                    f"({said}: {_rule(n_head)})")


def _rule(n_head: int) -> str:
    """ALiBi's slopes in words, as BLOOM's build_alibi_tensor makes them: 2^(-8 h / n) for a power of 2 heads, else
    those of the power of 2 below, then every other slope of the power of 2 above."""
    if n_head & (n_head - 1) == 0:
        return "2^(-8 h / n_head), h = 1 to n_head"
    m = 1 << (n_head.bit_length() - 1)
    return (f"2^(-8 h / {m}), h = 1 to {m}, {m} the power of 2 below n_head, then 2^(-4 h / {m}) for odd h = 1 "
            f"to {2 * (n_head - m) - 1}")


def _fit(b: Base, offset: int) -> torch.Tensor | None:
    """Per head, the slopes m of the user's biased scores less the reference's unbiased ones = m · j + a constant
    per row, from the first user tensor of the scores' shape where one such fit holds."""
    from attnscope.usertrace.maskcauses import fit_slopes

    scores = b.ref["scores"]
    for record in b.ctx.records:
        if tuple(record.tensor.shape) != tuple(user_out(b, "scores").shape) or not record.tensor.is_floating_point():
            continue
        slopes = fit_slopes(back_row(b, record.tensor.double()), scores, False)
        if slopes is not None:
            return torch.tensor([float(f"{m:.6g}") for m in slopes.tolist()], dtype=torch.float64)
    return None


def trials_alibi_queries(b: Base) -> Iterator[Trial]:
    parts = _alibi_parts(b)
    if parts is not None and not parts[2]:
        slopes, offset, _ = parts
        yield Trial(replay(b, bias=_alibi_bias(b, slopes, offset, symmetric=True)), "ALiBi's query positions: {who} "
                    "is what the reference computes with the bias −m_h · |i − j|, symmetric in the query and key "
                    "positions, where ALiBi adds −m_h · (i − j) = m_h · (j − i), a constant per query row plus m_h · j "
                    "(BLOOM's): keys after the query are pushed down as those before are" + _symmetric_hint(b))


def _symmetric_hint(b: Base) -> str:
    """Where no causal mask hides the keys after the query, the symmetric form is a bidirectional encoder's own
    ALiBi (JinaBERT's, MosaicBERT's), which --alibi does not describe: how to tell trace that it is meant."""
    spec = b.ctx.spec
    if spec is None or spec.causal:
        return ""
    return ("; if your model means it (a bidirectional encoder's ALiBi, JinaBERT's or MosaicBERT's), give it in "
            "place of --alibi as --position-bias FILE, a .npy of −m_h · |i − j| shaped [n_head, n_Q, n_K] "
            "(docs/trace.md, 'ALiBi written symmetric')")


def trials_alibi_after_softmax(b: Base) -> Iterator[Trial]:
    """ALiBi's bias added to the attention weights: the reference's, or, as a model hands it in (alibifeed.py), one
    row for every query, m_h · (j − n_K + 1), or symmetric, −m_h · |i − j| (Jais' AlibiPositionEmbeddingLayer); after
    the softmax a constant per row no longer cancels, nor do the cells a causal mask hides, so each is tried."""
    parts = _alibi_parts(b)
    if parts is None or b.ctx.spec is None or not b.ctx.spec.alibi:  # a --position-bias file: t5.after_softmax's
        return
    assert b.bias is not None
    slopes, offset, _ = parts
    row = -slopes[:, None, None] * (b.n_K - 1 - torch.arange(b.n_K, dtype=torch.float64))[None, None, :]
    symmetric = _alibi_bias(b, slopes, offset, symmetric=True)
    for bias, how in ((b.bias, "−m_h · (i − j)"), (row.to(b.bias), "m_h · (j − n_K + 1), one row for every query"),
                      (symmetric.to(b.bias), "−m_h · |i − j|, symmetric in i and j")):
        yield Trial(replay(b, bias=None, after_softmax=bias), "ALiBi's bias is added after the softmax: {who} is what "
                    f"the reference computes with ALiBi's bias ({how}) added to the attention weights, not to the "
                    "scores; ALiBi adds it to the scores before the softmax")


def _t5(b: Base) -> bool:
    return b.ctx.spec is not None and b.ctx.spec.position_bias is not None and b.bias is not None


def trials_t5_transposed(b: Base) -> Iterator[Trial]:
    if _t5(b) and b.n_Q == b.n_K and b.table is not None:  # a relative key table (keytable.py) read as P[j, i]
        from attnscope.usertrace.keytable import term

        assert b.bias is not None
        turned = b.bias + (term(b.q, b.table.transpose(0, 1)) - term(b.q, b.table)) * b.scale
        yield Trial(replay(b, bias=turned), "the relative key table is transposed: {who} is what the reference "
                    "computes with q_i · P[j, i] added to score (i, j) where Shaw's relative keys (SpeechT5's "
                    "position_bias) add q_i · P[i, j], the table's first axis the queries' and its second the keys'")
    elif _t5(b) and b.n_Q == b.n_K:
        assert b.bias is not None
        yield Trial(replay(b, bias=b.bias.transpose(-1, -2)), "the position bias is transposed: {who} is what the "
                    "reference computes with bias[j, i] added to score (i, j) where T5 adds bias[i, j] (its "
                    "relative_position = memory_position − context_position, keys minus queries)")


def trials_t5_after_softmax(b: Base) -> Iterator[Trial]:
    if _t5(b):
        words = ("the position bias is added after the softmax: {who} is what the reference computes with the bias "
                 "added to the attention weights, not to the scores; T5 adds position_bias to the scores before the "
                 "softmax")
        yield Trial(replay(b, bias=None, after_softmax=b.bias), words)
        if has_mask(b):  # the masked weights set to 0 again after it, as code that fills them twice does (CPM-Ant's
            # masked_fill(mask, 0) after the softmax, a no-op where the bias comes first)
            assert b.bias is not None and b.allowed is not None
            kept = torch.where(b.allowed, b.bias, torch.zeros_like(b.bias))
            yield Trial(replay(b, bias=None, after_softmax=kept, zeroed=True), words.replace(
                "to the attention weights, not", "to the attention weights (the masked ones then set to 0, as your "
                "code does), not"))


def _cap_origin(b: Base) -> str:
    spec = b.ctx.spec
    if spec is not None and spec.softcap_from_module:
        return f"the softcap your module's config says, {b.softcap:g},"
    return f"--softcap {b.softcap:g}"


def trials_softcap_missing(b: Base) -> Iterator[Trial]:
    if b.softcap is not None:
        c = f"{b.softcap:g}"
        yield Trial(replay(b, softcap=None), f"the scores are never capped: {{who}} is what the reference computes "
                    f"without the softcap, where {_cap_origin(b)} caps them, {c} · tanh(scores / {c}), before the "
                    f"mask; cap them (scores = {c} * torch.tanh(scores / {c}), Gemma 2's attn_logit_softcapping)")


def trials_softcap_after_mask(b: Base) -> Iterator[Trial]:
    if b.softcap is not None and has_mask(b):
        c = f"{b.softcap:g}"
        yield Trial(replay(b, cap="after mask"), f"the softcap is applied after the mask: {{who}} is what the "
                    f"reference computes with the masked scores capped, so a masked score (-inf, finfo.min) becomes "
                    f"-{c} and the keys the mask forbids keep a weight of e^-{c}; cap the scores, {c} · "
                    f"tanh(scores / {c}), before adding the mask")


def trials_softcap_form(b: Base) -> Iterator[Trial]:
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


def trials_softcap_untold(b: Base) -> Iterator[Trial]:
    """A cap of the code's own the reference was not told of: C solved from the user's tensors that are the scores
    capped."""
    if b.softcap is not None or "scores" not in b.ref:
        return
    for c in dict.fromkeys(_caps_solved(b)):
        said = f"{c:g}"
        yield Trial(replay(b, softcap=c), f"your code caps the scores, {said} · tanh(scores / {said}), which the "
                    f"reference was not told of: {{who}} is what the reference computes so capped; if that cap is "
                    f"your model's (Gemma 2's attn_logit_softcapping), describe it with --softcap {said}")


def trials_softcap_value(b: Base) -> Iterator[Trial]:
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

    scores = user_out(b, "scores")
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
