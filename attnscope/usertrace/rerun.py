"""The reference run again from its own heads, with one mistake applied: the engine of the experiments
(usertrace/experiments.py holds the catalog of mistakes; diagnose.py asks it first).

`Base` takes from the reference's trace what its attention starts from (the rotated queries, the keys and values
before the head repeat, the scale, the bias, the allowed cells, the output projection), in float64 and in the row
form (`--layout col` is transposed in and out). `replay(base, **change)` computes the steps from there on, as
attnscope's `sdpa` and `MultiHeadAttention` do (scores · scale, + bias, masked with -inf, softmax over the keys,
zero rows for a query that may see no key, @ V, heads merged with the permute, W_o), with one change applied.
Replayed without a change it must give the reference's own steps back, else no experiment is run.

`reproduces(base, step, steps)` says whether a replayed run is what the user's code computed: its last step (the
module's output, the function's `out`) equals one of the user's tensors to tolerance, and so does the step where
the line-up diverged, which the mistake must change; and the agreement is evidence of the mistake (evidence.py: NaN
met by NaN is nobody's).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ParamSpec

import torch

from attnscope.attention.stages import merge_heads
from attnscope.errors import UsageError
from attnscope.usertrace import scoreaxes
from attnscope.usertrace.align import (
    PRE_SOFTMAX,
    SCALABLE,
    VERY_NEGATIVE,
    best_scaled,
    best_shifted,
    compare,
    difference,
    filled,
    tolerance,
)
from attnscope.usertrace.evidence import evidenced
from attnscope.usertrace.headmix import mix

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from attnscope.usertrace.diagnosis import Context
    from attnscope.usertrace.record import Record

KEEP: Any = object()  # a replay argument left as the reference has it
# an additive mask's large number (BERT's extended mask, −10000): added to the masked scores, it leaves them in a
# column masked whole, which a softmax over another axis then normalizes as they are (−1e30 would erase them)
ADDED = -1e4
# Q_full, K_full: latent attention's heads, no-RoPE part and rotary part joined (usertrace/latentref.py)
Q_NAMES = ("Q_tuned", "Q_full", "Q_rot", "Q_normed", "Q_split", "Q")  # latent attention tunes its Q_full
K_NAMES = ("K_full", "K_rot", "K_normed", "K_split", "K")
V_NAMES = ("V_normed", "V_split", "V")


@dataclass
class Base:
    """What the reference's attention starts from, float64, row form: heads `[.., n_head, n, d]`."""

    ctx: Context
    order: list[str]  # the reference's steps, in order
    dims: dict[str, tuple[str, ...]]
    ref: dict[str, torch.Tensor]  # every step, float64, row form
    q: torch.Tensor  # the queries the scores read (rotated, tuned)
    k_new: torch.Tensor  # the new keys, rotated, before the cache joins and the heads repeat
    v_new: torch.Tensor
    names: dict[str, str]  # which step q, k_new and v_new are ("Q_rot", "K_rot", "V_split", ...)
    cache: tuple[torch.Tensor, torch.Tensor] | None  # (K_cache, V_cache), rotated keys
    n_group: int
    scale: float
    bias: torch.Tensor | None  # added to the scores (ALiBi's or a position bias), [.., n_Q, n_K]
    allowed: torch.Tensor | None  # True = may attend, the scores' shape
    w_o: tuple[torch.Tensor, torch.Tensor | None] | None
    col: bool
    kind: str
    sizes: dict[str, int] = field(default_factory=dict)
    softcap: float | None = None  # the scores capped, softcap · tanh(scores / softcap), before the bias and mask
    sums: dict[int, float] = field(default_factory=dict)  # each user tensor's sum, by record index (record_holding)
    # The cached keys as the code holds them, before RoPE, where it joins its cache first and rotates the joined keys
    # at their positions (cachekeys.py; Spec.cache_before_rope): an experiment that changes the keys or the join
    # rotates the join, the cached keys with the new ones. None: the cache holds rotated keys (transformers')
    raw_keys: torch.Tensor | None = None
    # The code's own term on the scores where it adds it before the scale (Spec.own_term, ownterm.py): held in `bias`
    # at the reference's scale, and scaled with the scores where an experiment changes the scale
    pre_term: torch.Tensor | None = None
    # The code's own term on its attention's output (Spec.out_term, outterm.py), added to x_raw as the code adds it
    post_term: torch.Tensor | None = None
    # ... the code's queries (Spec.out_queries), where the scores read them as they are split (q is Q_split): a replay
    # that changes q adds the change too
    post_queries: bool = False
    # The code's own output gate (Spec.out_gate, outgate.py), x_raw's layout: the merged heads multiplied by it (each
    # head's output before the merge where the code gates attn @ v as it is: `gate_first`)
    gate: torch.Tensor | None = None
    gate_first: bool = False
    # The module's attention sinks (Spec.sinks, sinkcols.py), `[n_head]`: one more column in each softmax row, dropped
    sinks: torch.Tensor | None = None
    # The code's own scale per head (Spec.head_scale, headscale.py), over the reference's `scale`: `[n_head, 1, 1]`,
    # each head's scaled scores times it, whatever scale an experiment tries
    head: torch.Tensor | None = None
    # The code's mixing of its heads (Spec.head_mix, headmix.py), [n_head, n_head + 1] each: the scores mixed before the
    # bias and the mask, the weights after the softmax
    mix_pre: torch.Tensor | None = None
    mix_post: torch.Tensor | None = None
    # The dtypes the code computes its attention in where it runs it in float16 or bfloat16 (halfprec.in_code_dtype:
    # q, k_new and v_new are then the code's own heads): every replay computes in them unless told otherwise
    precision: dict[str, torch.dtype] | None = None
    # A relative key table `[n_Q, n_K, d_head]` (--position-bias, keytable.py) whose term q_i · P[i, j] · scale `bias`
    # holds: a replay that changes the queries recomputes the term from them
    table: torch.Tensor | None = None
    # The catalog's runs made from here, by entry name, each with its changes (trials.runs: made once, as by_experiment
    # or a pair of mistakes first asks for them); two of them joined make one run with both mistakes (pairs.by_pair)
    runs: dict[str, list[Any]] = field(default_factory=dict)
    # The heads split strided and merged back so, head the fastest (Spec.strided_heads, stridedheads.py: SuperGlue's
    # checkpoint layout): every replay's merge so, and a trial's split of features
    strided: bool = False
    # The code's records that may hold the attention's output (_from_scores), found at the first rerun compared
    scored_from: set[int] | None = None

    @property
    def n_Q(self) -> int:
        return int(self.q.shape[-2])

    @property
    def n_K(self) -> int:
        return int(self.k_new.shape[-2]) + (int(self.cache[0].shape[-2]) if self.cache is not None else 0)

    @property
    def n_cache(self) -> int:
        return int(self.cache[0].shape[-2]) if self.cache is not None else 0

    @property
    def d_head(self) -> int:
        return int(self.q.shape[-1])

    @property
    def last(self) -> str:
        return self.order[-1]

    def plain(self, name: str) -> torch.Tensor | None:
        """A step before any rotation: `Q_normed`/`Q_split`/`Q` for "Q", likewise "K", "V"; the first laid out in
        heads as the rotated one is (a qk-norm over the whole projection, OLMo 2's, comes before the split: its
        `Q_normed` is `[n_batch, n, d_feat]` and `Q_split` the normed queries in heads)."""
        from attnscope.usertrace.reference import late_norm

        found = [self.ref[c] for c in (f"{name}_normed", f"{name}_split", name) if c in self.ref
                 and not late_norm(self.order, c)]
        rotated = {"Q": self.q, "K": self.k_new, "V": self.v_new}.get(name)
        shaped = [t for t in found if rotated is not None and t.shape == rotated.shape]
        return (shaped or found)[0] if found else None


def build(ctx: Context) -> Base | None:
    """The reference's starting point, or None where the replay cannot stand for it (sinks, dropout in training
    mode, a reference the replay does not give back)."""
    trace = ctx.reference
    names = [step.name for step in trace.steps]
    sunk = ctx.spec is not None and ctx.spec.sinks is not None  # the module's own, which the replay joins too
    if ctx.train or "index_scores" in names or (not sunk and any(n in names for n in ("sinks", "sink_weight"))):
        return None
    if "scores" not in names or "attention" not in names:
        return None
    col = ctx.spec is not None and ctx.spec.layout == "col"
    ref = {n: _row(trace[n].double(), n, col) for n in names if trace[n].is_floating_point()}
    # the first laid out in heads as the split is (a qk-norm over the projection, OLMo 2's, is [.., d_feat])
    q_name = next((n for n in _placed(Q_NAMES, names) if n in ref and _heads_like(ref, n, "Q_split")), None)
    k_name = next((n for n in _placed(K_NAMES, names) if n in ref and _heads_like(ref, n, "K_split")), None)
    v_name = next((n for n in V_NAMES if n in ref), None)
    if q_name is None or k_name is None or v_name is None or ref[q_name].dim() < 2:
        return None
    cache = (ref["K_cache"], ref["V_cache"]) if "K_cache" in ref and "V_cache" in ref else None
    q, k_new, v_new = ref[q_name], ref[k_name], ref[v_name]
    n_kv = k_new.shape[-3] if k_new.dim() >= 3 else 1
    n_head = q.shape[-3] if q.dim() >= 3 else 1
    n_group = n_head // n_kv if n_kv and n_head % n_kv == 0 else 1
    scale = ctx.spec.scale if ctx.spec is not None and ctx.spec.scale is not None else 1 / math.sqrt(q.shape[-1])
    softcap = ctx.spec.softcap if ctx.spec is not None and "capped_scores" in ref else None
    bias = None
    if "biased_scores" in ref:
        logits = ref["capped_scores"] if softcap is not None else ref["scores"]
        bias = torch.where(torch.isfinite(ref["biased_scores"]), ref["biased_scores"] - logits, 0.0)
        shift = None if col else _row_shift(ctx.records, ref["biased_scores"])
        if shift is not None:  # the user's bias is the reference's plus a constant per row (MPT's ALiBi): its own
            bias = bias + shift
            ref["biased_scores"] = ref["biased_scores"] + shift
            if "masked_scores" in ref:
                ref["masked_scores"] = ref["masked_scores"] + shift
    # masked: -inf, or a large number added (a --mask file of BERT's −10000, the code's own convention)
    allowed = None
    if "masked_scores" in ref:
        masked, fills = torch.isneginf(ref["masked_scores"]), filled(ref["masked_scores"])
        allowed = ~masked if fills is None else ~(masked | fills)
    w_o = None
    if ctx.projections is not None and "o" in ctx.projections.linears:
        out = ctx.projections.linears["o"][1]
        weight, b = getattr(out, "weight", None), getattr(out, "bias", None)
        if isinstance(weight, torch.Tensor):
            w_o = (weight.detach().double(), b.detach().double() if isinstance(b, torch.Tensor) else None)
    base = Base(ctx, names, {n: trace.step(n).dims for n in names}, ref, q, k_new, v_new,
                {"q": q_name, "k": k_name, "v": v_name}, cache, n_group, scale, bias, allowed, w_o, col, ctx.kind,
                dict(ctx.sizes), softcap)
    base.strided = ctx.spec is not None and ctx.spec.strided_heads
    if cache is not None and ctx.spec is not None and ctx.spec.cache_before_rope:
        from attnscope.usertrace.cachekeys import rotated_back

        base.raw_keys = rotated_back(cache[0], ctx.spec)
    if ctx.spec is not None and base.bias is not None and not col:
        base.table = _table(ctx.spec, ref, q)
    if ctx.spec is not None and ctx.spec.own_term is not None and ctx.spec.term_before_scale and not col:
        base.pre_term = ctx.spec.own_term.double()
    if ctx.spec is not None and ctx.spec.out_term is not None and not col:
        base.post_term = ctx.spec.out_term.double()
        base.post_queries = ctx.spec.out_queries and q_name == "Q_split"
    if ctx.spec is not None and ctx.spec.out_gate is not None and not col:
        base.gate, base.gate_first = ctx.spec.out_gate.double(), ctx.spec.gate_before_merge
    if sunk and ctx.spec is not None:
        base.sinks = ctx.spec.sinks.detach().double().reshape(-1)
    if ctx.spec is not None and ctx.spec.head_scale is not None and not col:
        from attnscope.usertrace.headscale import replay_factor

        base.head = replay_factor(ctx.spec.head_scale, scale)
    if ctx.spec is not None and ctx.spec.head_mix is not None and not col:
        base.mix_pre, base.mix_post = (None if m is None else m.double() for m in ctx.spec.head_mix)
        if base.mix_pre is not None and base.bias is not None:  # the bias the code adds to its mixed scores
            logits = ref["capped_scores"] if softcap is not None else ref["scores"]
            base.bias = base.bias + logits - mix(logits, base.mix_pre, -3)
    try:
        again = replay(base)
    except RuntimeError:  # shapes the replay does not know (an unbatched column form, ...)
        return None
    if not again or not (_gives_reference(base, again) or _gives_reference(base, replay(base, precision=SINGLE))):
        return None  # the replay is not the reference here: no experiment can speak for it
    return base


def _table(spec: Any, ref: dict[str, torch.Tensor], q: torch.Tensor) -> torch.Tensor | None:
    """--position-bias as a relative key table (keytable.py) for these scores, float64; None where it is none."""
    from attnscope.usertrace.keytable import table_of

    try:
        table = table_of(spec.position_bias, tuple(ref["scores"].shape), int(q.shape[-1]))
    except UsageError:
        return None
    return None if table is None else table.double()


# the reference's attention as trace computes it, in float32: where its scores run large (thousands), their float32
# rounding, which the softmax turns into the weights', parts it from the float64 replay though both are right
SINGLE = {"product": torch.float32, "scores": torch.float32, "attention": torch.float32}


def _gives_reference(base: Base, again: dict[str, torch.Tensor]) -> bool:
    return all(difference(again[n], base.ref[n]) <= _tol(base.ref[n]) for n in again)


def _placed(names: tuple[str, ...], order: list[str]) -> tuple[str, ...]:
    """`names`, the nearest the scores first, with a qk-norm made after the rotation before it."""
    from attnscope.usertrace.reference import late_norm

    late = [n for n in names if late_norm(order, n)]
    if not late:
        return names
    rotated = late[0].replace("_normed", "_rot")
    rest = [n for n in names if n != late[0]]
    return (*rest[:rest.index(rotated)], late[0], *rest[rest.index(rotated):])


def _heads_like(ref: dict[str, torch.Tensor], name: str, split: str) -> bool:
    """Whether step `name` is laid out as `split` (in heads) where the reference has that step."""
    return split not in ref or name == split or ref[name].shape == ref[split].shape


P = ParamSpec("P")
# the replays made while `watching` (pairs.py): each run's steps and the changes it was given, so that two mistakes'
# changes of different arguments make one run with both
_WATCHERS: list[list[tuple[dict[str, torch.Tensor], dict[str, Any]]]] = []


@contextmanager
def watching() -> Iterator[list[tuple[dict[str, torch.Tensor], dict[str, Any]]]]:
    """Each replay made inside, with the changes it was given (`replay(b, **change)`), in order."""
    seen: list[tuple[dict[str, torch.Tensor], dict[str, Any]]] = []
    _WATCHERS.append(seen)
    try:
        yield seen
    finally:
        _WATCHERS.remove(seen)


def _watched(run: Callable[P, dict[str, torch.Tensor]]) -> Callable[P, dict[str, torch.Tensor]]:
    def watched(*args: P.args, **change: P.kwargs) -> dict[str, torch.Tensor]:
        steps = run(*args, **change)
        for seen in _WATCHERS:
            seen.append((steps, dict(change)))
        return steps

    watched.__doc__ = run.__doc__
    return watched


@_watched
def replay(b: Base, *, q: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
           v_new: torch.Tensor | None = None, cat_order: str = "cache first", repeat: str = "interleave",
           scale: float | None = None, bias: Any = KEEP, allowed: Any = KEEP, mask: str = "fill",
           softmax_dim: int = -1, after_softmax: torch.Tensor | None = None, multiplier: torch.Tensor | None = None,
           merge: str = "permute", half: bool = False, swap_cache: bool = False, softcap: Any = KEEP,
           cap: str = "capped", joined: tuple[torch.Tensor, torch.Tensor] | None = None,
           before: torch.Tensor | None = None, dropped: dict[str, torch.Tensor] | None = None,
           zeroed: bool = False, precision: dict[str, torch.dtype] | None = None,
           weights_t: bool = False, masked_as: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The reference's steps from its heads on, with the changes given: only the steps the reference has, in the
    row form. `softcap` C caps the scores as `cap` says: "capped" C · tanh(scores / C) (Gemma 2's), "after mask"
    the masked scores capped (-inf becomes -C), "no multiply" tanh(scores / C), "no divide" C · tanh(scores),
    "unscaled" C · tanh(q · kᵀ / C) scaled after. `joined`: the keys and values after the cache joins them, as an
    experiment made them (code that joins its cache before RoPE rotates the join), in place of the cache joined to
    `k_new` and `v_new`. `before` (True = may attend): a mask applied to the scores before the softmax, where `mask`
    applies `allowed` after it (a padding mask before, the causal rule after). `dropped`: a multiplier (a dropout's
    0 or 1/(1 − p) per entry) for a step after the attention (`x_raw` or `out`, `x_rsh2`, `x`), applied to it there
    (a dropout on the output, before or after the output projection). `zeroed`: the weights the mask forbids set to 0
    after the softmax, as the code's own op does there (ESPnet's `softmax(scores).masked_fill(mask, 0.0)`), whatever
    axis the softmax ran over. `precision`: the dtype the code computes each of q @ kᵀ ("product"), the
    scaled scores ("scores") and the softmax and its weighted sum of the values ("attention") in, as code that runs
    its attention in float16 does (halfprec.py); a step it leaves out is computed in float64. `weights_t`: the
    weights transposed before they meet the values (`attn.transpose(-2, -1) @ v`, square scores alone).
    `masked_as` (mask "own"): the scores as the code's softmax takes them (scaletrials.code_masked: GPT-2's first
    code's −10000 for the causal rule and −10000 more for padding, −20000 where both mask; a row's max taken out)."""
    dropped = dropped or {}
    precision = b.precision if precision is None else precision
    out: dict[str, torch.Tensor] = {}
    q = b.q if q is None else q
    k = b.k_new if k_new is None else k_new
    v = b.v_new if v_new is None else v_new
    if q is not b.q:
        out[b.names["q"]] = q
    asked_q = q
    if k is not b.k_new:
        out[b.names["k"]] = k
    if v is not b.v_new:
        out[b.names["v"]] = v
    if joined is not None:
        k, v = joined
        out["K_cat"], out["V_cat"] = k, v
    elif b.cache is not None:
        cached = b.cache[::-1] if swap_cache else b.cache  # swap_cache: K_cache joined to the values, V_cache the keys
        parts = [(cached[0], k), (cached[1], v)]
        k, v = (torch.cat(p if cat_order == "cache first" else p[::-1], dim=-2) for p in parts)
        out["K_cat"], out["V_cat"] = k, v
    if b.n_group > 1:
        if repeat == "interleave":  # transformers' repeat_kv
            k, v = k.repeat_interleave(b.n_group, dim=-3), v.repeat_interleave(b.n_group, dim=-3)
        else:  # .repeat(1, n_group, 1, 1): the heads tiled
            k, v = (t.repeat(*([1] * (t.dim() - 3)), b.n_group, 1, 1) for t in (k, v))
        out["K_rep"], out["V_rep"] = k, v
    s = b.scale if scale is None else scale
    if precision:  # [.., n, d] each, in the code's dtype where the code computes q @ kᵀ in it
        q, k = q.to(precision.get("product", q.dtype)), k.to(precision.get("product", k.dtype))
    if half:  # q @ kᵀ in float16, as the user's code computes it: past 65504 it is inf
        product = (q.half() @ k.half().transpose(-2, -1)).double()  # [.., n_Q, d] @ [.., d, n_K] -> [.., n_Q, n_K]
    else:
        product = q @ k.transpose(-2, -1)  # [.., n_Q, d] @ [.., d, n_K] -> [.., n_Q, n_K]
    cap_at = b.softcap if softcap is KEEP else softcap
    if precision:
        product = product.to(precision.get("scores", torch.float64))
    scores = product * s if b.head is None else product * s * b.head.to(product.dtype)  # the code's own per head
    out["scores"] = scores
    logits = scores
    if cap_at is not None and cap != "after mask":
        forms = {"capped": lambda t: cap_at * torch.tanh(t / cap_at), "no multiply": lambda t: torch.tanh(t / cap_at),
                 "no divide": lambda t: cap_at * torch.tanh(t),
                 "unscaled": lambda t: cap_at * torch.tanh(t / s / cap_at) * s}
        logits = forms[cap](scores)
        if cap == "unscaled":  # the code's scores are q · kᵀ as it is, scaled only after the cap
            out["scores"] = product
    if cap != "after mask":
        out["capped_scores"] = logits  # a run without the cap: the scores as they are, where the reference caps
    if b.mix_pre is not None:  # the code's heads mixed before its mask (headmix.py)
        logits = mix(logits, b.mix_pre, -3)
    if bias is KEEP and b.table is not None and asked_q is not b.q:  # the key table's term from the queries changed
        from attnscope.usertrace.keytable import keyed_bias

        bias = keyed_bias(b.bias, b.table, b.q, asked_q.double(), b.scale)
    bias = b.bias if bias is KEEP else bias
    logits = logits + bias.to(logits.dtype) if bias is not None else logits
    if b.pre_term is not None and s != b.scale:  # the code's own term, added before the scale, scaled with it
        logits = logits + b.pre_term * (s - b.scale)
    if "biased_scores" in b.ref:
        out["biased_scores"] = logits
    allowed = b.allowed if allowed is KEEP else allowed
    if allowed is not None and mask in ("fill", "zero", "finite", "zero, then after"):  # finite: -1e9, large negative
        logits = logits.masked_fill(~allowed, -math.inf if mask == "fill" else
                                   max(-1e30, torch.finfo(logits.dtype).min) if mask == "finite" else 0.0)
    if allowed is not None and mask == "added":  # a large number added (BERT's (1 − mask) · −10000): scores kept,
        # to float32's precision there, as code in float32 keeps them
        logits = torch.where(allowed, logits, (logits.float() + ADDED).double())
    if mask == "own" and masked_as is not None:  # the code's own, as its softmax takes them
        logits = masked_as.to(logits.dtype)
    if before is not None:
        logits = logits.masked_fill(~before, -math.inf)
    if cap_at is not None and cap == "after mask":  # the mask's -inf (finfo.min) capped to -C: masked keys keep weight
        logits = cap_at * torch.tanh(logits / cap_at)
        out["capped_scores"] = logits
    if "masked_scores" in b.ref:
        out["masked_scores"] = logits
    if precision:
        logits, v = logits.to(precision.get("attention", torch.float64)), v.to(precision.get("attention", v.dtype))
    if b.sinks is not None and softmax_dim == -1 and logits.dim() >= 3:  # one more column, a logit a head, dropped
        column = b.sinks.reshape(-1, 1, 1).expand(*logits.shape[:-1], 1)
        attention = torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :-1]
    else:
        attention = torch.softmax(logits, dim=softmax_dim)
    if mask == "fill" and softmax_dim == -1 and b.sinks is None:  # a query that may see no key: zeros (_safe_softmax)
        attention = attention.masked_fill(torch.isneginf(logits).all(-1, keepdim=True), 0.0)
    if allowed is not None and mask in ("after", "zero, then after"):  # ESPnet's masked_fill(mask, 0.0) after it too
        attention = attention * allowed
    if allowed is not None and zeroed:  # masked_fill, as the code's: a column of NaN (-inf over n_Q) is 0 too
        attention = attention.masked_fill(~allowed, 0.0)
    if allowed is not None and mask == "added after":  # an additive mask (0 / -inf) added to the weights (CLIP's)
        attention = attention + torch.zeros_like(attention).masked_fill(~allowed, -math.inf)
    if b.mix_post is not None:  # the code's weights mixed across its heads after its softmax (headmix.py)
        attention = mix(attention, b.mix_post, -3)
    if after_softmax is not None:
        attention = attention + after_softmax
    if multiplier is not None:
        attention = attention * multiplier
    out["attention"] = attention
    pattern = attention.transpose(-2, -1) if weights_t else attention  # [.., n_K, n_Q] where n_Q = n_K
    x = (pattern @ v).double()  # [.., n_Q, n_K] @ [.., n_K, d_V] -> [.., n_Q, d_V]
    if b.post_term is not None and tuple(b.post_term.shape) == tuple(x.shape):
        x = x + b.post_term  # the code's own term on its output, as its run made it
        if b.post_queries and q is not b.q and tuple(q.shape) == tuple(x.shape):
            x = x + (q - b.q)  # the code adds the queries it scores: the replay's, changed as the mistake changed them
    final = "x_raw" if "x_raw" in b.ref else "out"
    x = x * dropped[final] if final in dropped else x
    out[final] = x
    gate = b.gate if b.gate is not None and tuple(b.gate.shape) == tuple(x.shape) else None
    if final == "x_raw" and x.dim() == 4:
        merged = _merged(x, merge, out, "x_rsh1" in b.ref, b.strided)
        merged = merged * dropped["x_rsh2"] if "x_rsh2" in dropped else merged
        if "x_rsh2" in b.ref:
            out["x_rsh2"] = merged
        if gate is not None:  # the heads' output times the code's gate (outgate.py), as the code gates it
            out["gate"] = merge_heads(gate)  # [n_batch, n_head, n_Q, d_head] -> [n_batch, n_Q, d_feat]
            # before the merge where the code gates attn @ v as it is (the merge, right or wrong, after the gate)
            merged = _merged(x * gate, merge, {}, False, b.strided) if b.gate_first else merged * out["gate"]
            out["x_gated"] = merged
        if "x" in b.ref and b.w_o is not None:
            out["x"] = torch.nn.functional.linear(merged, *b.w_o)  # [n_batch, n_Q, d_feat]
            out["x"] = out["x"] * dropped["x"] if "x" in dropped else out["x"]
    return {n: t.double() for n, t in out.items() if n in b.ref}


def _merged(x: torch.Tensor, merge: str, out: dict[str, torch.Tensor], keep: bool, strided: bool = False
            ) -> torch.Tensor:
    """x_raw `[n_batch, n_head, n_Q, d_head]` merged to `[n_batch, n_Q, n_head·d_head]` as `merge` says: with the
    permute (x_rsh1 kept in `out` where `keep`), a view without it ("view"; "column view": viewed as the column
    form's `[n_batch, n_head·d_head, n_Q]`, d_head never moved in front of n_Q), or viewed straight as time-first.
    `strided`: the permute lays the head the fastest, `[n_batch, n_Q, d_head, n_head]` (a strided split's merge)."""
    n_batch, n_head, n_Q, d = x.shape
    if strided and merge == "permute":
        x_rsh1 = x.permute(0, 2, 3, 1)  # [n_batch, n_head, n_Q, d_head] -> [n_batch, n_Q, d_head, n_head]
        if keep:
            out["x_rsh1"] = x_rsh1
        return x_rsh1.reshape(n_batch, n_Q, n_head * d)
    if merge == "column view":  # SqueezeBert's transpose_output without its permute(0, 1, 3, 2)
        return x.reshape(n_batch, n_head * d, n_Q).transpose(-2, -1)
    x_rsh1 = x.permute(0, 2, 1, 3)  # [n_batch, n_head, n_Q, d_head] -> [n_batch, n_Q, n_head, d_head]
    if keep and merge == "permute":
        out["x_rsh1"] = x_rsh1
    # -> [n_batch, n_Q, n_head·d_head]; without the permute, each row mixes one head's positions
    merged = (x_rsh1 if merge == "permute" else x).reshape(n_batch, n_Q, n_head * d)
    if merge == "time":  # time-first [n_batch·n_head, n_Q, d_head] viewed as [n_Q, n_batch, d_feat] (fairseq)
        merged = x.reshape(n_Q, n_batch, n_head * d).transpose(0, 1)  # -> [n_batch, n_Q, d_feat]
    return merged


def _row_shift(records: list[Record], biased: torch.Tensor) -> torch.Tensor | None:
    """The constant per query row `[.., n_Q, 1]` that the user's biased scores add to the reference's (MPT's
    ALiBi `m_h · (j − n + 1)` for `−m_h · (i − j)`: the same softmax), read off the user's tensor equal to them
    up to such a constant (align.best_shifted); None where the user holds them as they are, or no such tensor."""
    from attnscope.usertrace.align import best_equal

    if best_equal(records, biased, None) is not None:
        return None
    found = best_shifted(records, biased, -1)
    if found is None:
        return None
    user = found.layout.undo(found.record.tensor, tuple(biased.shape)).double()
    kept = torch.isfinite(biased) & torch.isfinite(user)
    count = kept.sum(-1, keepdim=True).clamp_min(1)
    return torch.where(kept, user - biased, 0.0).sum(-1, keepdim=True) / count  # [.., n_Q, 1]


@dataclass
class Reproduced:
    """An experiment's run that is the user's: the user's tensor at the diverging step (or the first step the
    mistake changed that the user holds), the user's final tensor, and how many changed steps the user holds."""

    record: Record | None
    final: Record
    held: int
    steps: dict[str, torch.Tensor]
    earliest: tuple[str, Record] | None = None  # the first step the mistake changed that the user holds, its tensor


def holds_step(b: Base, step: str) -> bool:
    """Whether the user's code holds the reference's `step` after all (the line-up paired the step with another
    tensor on the same line, the matmul before its division say): then the divergence is not at `step`."""
    return step in b.ref and record_holding(b.ctx.records, _back(b.ref[step], b.col), None, "", b.sums) is not None


def _from_scores(b: Base) -> set[int]:
    """The code's records made from a tensor of the scores' size, a softmax or an exp (scores taken in blocks of
    rows, an online softmax) or a fused kernel, themselves included, and what the code returns (a head's attention
    `torch.vmap`ped, whose inner ops no record holds): those that may hold the attention's output.
    Every record where the reference has no scores."""
    from attnscope.usertrace.kernels import KERNELS
    from attnscope.usertrace.record import SOFTMAXES

    if "scores" not in b.ref:
        return {r.index for r in b.ctx.records}
    numel = b.ref["scores"].numel()
    made: set[int] = set()
    for r in b.ctx.records:  # in order: a record's parents come before it
        if (r.tensor.is_floating_point() and r.tensor.numel() == numel) or r.func in KERNELS \
                or r.func.split(".")[-1] in (*SOFTMAXES, "exp", "exp_", "logsumexp") or r.style == "recomputed" \
                or r.details.get("returned") is not None or any(p in made for p in r.parents):
            made.add(r.index)
    return made


def reproduces(b: Base, step: str, steps: dict[str, torch.Tensor], tol: str = "",
               strict: bool = True, evidence: bool = True) -> Reproduced | None:
    """Whether the replayed `steps` are the user's: the mistake changes `step` (where the line-up diverged) and
    the run's last step, and the user's code holds that last step (and the changed steps it materializes) to
    tolerance; not `strict` (the user holds the reference's `step` after all), `step` may be left as it is.
    `tol` "float16": compared within float16's tolerance (an experiment computed in float16). Without `evidence`,
    a run that gives the code's tensors back is enough (no mistake asked of it: the reference in the code's dtype)."""
    if b.last not in steps or (strict and step not in steps):
        return None
    changed = [n for n in b.order if n in steps and n in b.ref and tuple(steps[n].shape) == tuple(b.ref[n].shape)
               and difference(steps[n], b.ref[n]) > _tol(b.ref[n])]
    changed += [n for n in steps if n not in b.ref or tuple(steps[n].shape) != tuple(b.ref[n].shape)]
    if strict and step not in changed:  # the mistake leaves the diverging step as the reference has it
        return None
    skips = _skips(b, steps)
    if b.last in skips and bool(skips[b.last].all()):  # a run that masks every query compares nothing
        return None

    # identity projections (identity.py) make the output the merge of V: the run's last step is then held by what
    # the code computes from its scores, never by its own v (a rerun whose attention is the identity)
    identity = b.ctx.projections is not None and b.ctx.projections.matched_by == "identity"
    scored = next((r.index for r in b.ctx.records if "scores" in b.ref and r.tensor.is_floating_point()
                   and r.tensor.numel() == b.ref["scores"].numel()), None) if identity else None
    # the run's output is held only by a tensor of the code's made from its scores (or a kernel's): a rerun whose
    # weights leave each query its own value alone (a window of 1) gives the values back, which the code holds
    # before it ever scores (GIT's V split at its transpose_for_scores), no evidence of the mask
    if b.scored_from is None:  # the same for every trial of this base: found once
        b.scored_from = _from_scores(b)
    outputs = [r for r in b.ctx.records if r.index > scored] if scored is not None else \
        [r for r in b.ctx.records if r.index in b.scored_from]

    def held(name: str) -> Record | None:
        skip = skips.get(name)
        tensor, back = _back(steps[name], b.col), _back(skip, b.col) if skip is not None else None
        records = outputs if name == b.last else b.ctx.records
        dims = ("n_K", "n_Q") if b.col else ("n_Q", "n_K")  # a step of the scores' family, the user's layout
        turned = scoreaxes.turned(b.ctx.keys, dims) if name in (*PRE_SOFTMAX, "attention") else frozenset()
        # a row the run masks whole is left out of the comparison only where the code's row is masked too
        rows = (-2 if b.col else -1) if back is not None and name in (*PRE_SOFTMAX, "attention") else None
        found = record_holding(records, tensor, back, tol, b.sums, turned, rows=rows)
        if found is None and name in PRE_SOFTMAX and name != b.last:
            # a constant per query row, which the softmax takes out, is a convention (BLOOM's ALiBi m_h · j, its
            # bias fused into the scores' product: the run's biased scores, the user's up to such a constant)
            shifted = best_shifted(b.ctx.records, tensor, -2 if b.col else -1, back)
            found = shifted.record if shifted is not None and (rows is None or back is None or _row_masked(
                shifted.layout.undo(shifted.record.tensor, tuple(tensor.shape)), back, rows, _tol(tensor))) else None
        if found is None and name in SCALABLE:  # q or k with the scale applied early (ESM's q before RoPE)
            scaled = best_scaled(b.ctx.records, tensor, back)
            found = scaled.record if scaled is not None else None
        return found

    final = held(b.last) if b.ctx.returned is None else _gives_back(b, b.ctx.returned, steps[b.last], skips.get(b.last))
    if final is None or not _masks_rows(skips, steps, held):
        return None
    at_step = held(step) if step in changed else None
    holding: dict[str, Record] = {}
    for name in changed:
        record = held(name)
        if record is not None:
            holding[name] = record
    first = next(iter(holding.values()), None)
    # agreeing is not yet evidence: NaN met by NaN is no mistake's own (evidence.py)
    if evidence and not evidenced(b.order, b.last, b.ref, steps, skips, {**holding, b.last: final},
                     lambda ref, record: _tol(ref, record.tensor.dtype, tol)):
        return None
    return Reproduced(at_step or first or final, final, len(holding), steps, next(iter(holding.items()), None))


def _masks_rows(skips: dict[str, torch.Tensor], steps: dict[str, torch.Tensor],
                held: Callable[[str], Record | None]) -> bool:
    """Whether the code masks the rows of queries the run masks whole (which the comparison leaves out): where it
    computes the scores, its masked scores or its attention weights hold the run's with those rows masked (held
    checks them); code whose scores are not seen (a fused kernel) is not asked. A rerun that masks rows the code
    computes as ordinary ones gives nothing of the code back there."""
    if "masked_scores" not in skips or "scores" not in steps or held("scores") is None:
        return True
    return any(name in skips and held(name) is not None for name in ("masked_scores", "attention"))


def _row_masked(user: torch.Tensor, skip: torch.Tensor, axis: int, tol: float) -> bool:
    """Whether each of `user`'s rows along `axis` that `skip` leaves out is masked whole: NaN, very negative (a
    score), zero, or one value across the row (-1e9 everywhere, whose softmax is uniform)."""
    user = user.double()
    rows = skip.expand(user.shape).all(axis)
    if not bool(rows.any()):
        return True
    low = (torch.isnan(user) | (user <= VERY_NEGATIVE)).all(axis)
    zero = (user.abs() <= tol).all(axis)
    spread = (user.amax(axis) - user.amin(axis)).abs()
    flat = torch.isfinite(spread) & (spread <= tol)
    return bool((low | zero | flat)[rows].all())


def _gives_back(b: Base, returned: Record, tensor: torch.Tensor, skip: torch.Tensor | None) -> Record | None:
    """`returned` (what the code handed back, where the line-up diverged at it) where it holds the run's last step
    `tensor` in some layout, else None: an inner tensor of the code that holds it is not what the call returned."""
    back = _back(skip, b.col) if skip is not None else None
    matches = compare(returned, _back(tensor, b.col), back, tol=_tol(tensor, returned.tensor.dtype))
    return returned if matches and matches[0].equal else None


def record_holding(records: list[Record], tensor: torch.Tensor, skip: torch.Tensor | None, tol: str,
          sums: dict[int, float], turned: frozenset[int] = frozenset(), rows: int | None = None) -> Record | None:
    """The user's tensor equal to `tensor` in some layout (an equal-size transpose is no layout, but where the data
    flow says the record holds the last two axes the other way round: `turned`), the named and earliest first.
    `rows` (an axis of `tensor`): the rows `skip` leaves out must be masked whole in the user's too (_row_masked)."""
    found = []
    numel, limits = tensor.numel(), {}
    total = float(tensor.sum()) if skip is None else math.nan  # a layout moves values, never changes their sum
    for record in records:
        if not record.tensor.is_floating_point() or record.tensor.numel() != numel:
            continue
        dtype = record.tensor.dtype
        if dtype not in limits:
            limits[dtype] = _tol(tensor, dtype, tol)
        if math.isfinite(total):
            theirs = _sum(record, sums)
            if math.isfinite(theirs) and abs(theirs - total) > numel * limits[dtype]:
                continue
        matches = compare(record, tensor, skip, tol=limits[dtype], turned=record.index in turned)
        if matches and matches[0].equal and (rows is None or skip is None or _row_masked(
                matches[0].layout.undo(record.tensor, tuple(tensor.shape)), skip, rows, limits[dtype])):
            found.append(record)
    return min(found, key=lambda r: (not r.names, r.index)) if found else None


def _sum(record: Record, sums: dict[int, float]) -> float:
    """The record's values summed in float64, once per record (`sums`, by record index)."""
    if record.index not in sums:
        sums[record.index] = float(record.tensor.double().sum())
    return sums[record.index]


def _tol(tensor: torch.Tensor, dtype: torch.dtype = torch.float32, tol: str = "") -> float:
    """float32's tolerance at least (the reference's own), the user's dtype's where coarser, float16's when asked."""
    wanted = [tolerance(tensor, torch.float32)]
    if dtype in (torch.float16, torch.bfloat16):
        wanted.append(tolerance(tensor, dtype))
    if tol == "float16":
        wanted.append(tolerance(tensor, torch.float16))
    return max(wanted)


def _skips(b: Base, steps: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per step from the masked scores on, the rows of queries that may see no key in this run (row form, each the
    step's shape), left out of the comparison as the line-up leaves them out (refruns.skipped_rows)."""
    masked = steps.get("masked_scores", b.ref.get("masked_scores"))
    if masked is None:
        return {}
    empty = torch.isneginf(masked).all(-1)  # [.., n_Q]
    if not bool(empty.any()):
        return {}
    rows = empty[..., None]  # [.., n_Q, 1]: broadcasts over the scores, the attention, x_raw / out
    skips: dict[str, torch.Tensor]
    skips = {n: rows.expand(steps[n].shape) for n in ("masked_scores", "attention", "x_raw", "out")
             if n in steps and steps[n].dim() == rows.dim() and steps[n].shape[:-1] == rows.shape[:-1]}
    merged = empty.any(-2)[..., None] if empty.dim() >= 2 else None  # [n_batch, n_Q, 1]: after the heads merge
    for n in ("x_rsh2", "x"):
        if merged is not None and n in steps and steps[n].dim() == 3 and steps[n].shape[:-1] == merged.shape[:-1]:
            skips[n] = merged.expand(steps[n].shape)
    if merged is not None and "x_rsh1" in steps and steps["x_rsh1"].dim() == 4:
        skips["x_rsh1"] = merged[..., None].expand(steps["x_rsh1"].shape)
    return skips


def _row(tensor: torch.Tensor, name: str, col: bool) -> torch.Tensor:
    """The column form's steps in the row form: scores `[.., n_K, n_Q]` -> `[.., n_Q, n_K]`, `Q` `[.., d, n]` ->
    `[.., n, d]`."""
    return tensor.transpose(-2, -1) if col and tensor.dim() >= 2 else tensor


def _back(tensor: torch.Tensor, col: bool) -> torch.Tensor:
    """A row-form tensor in the user's layout (the column form's, transposed)."""
    return tensor.transpose(-2, -1) if col and tensor.dim() >= 2 else tensor


def _row_dims(dims: tuple[str, ...], col: bool) -> tuple[str, ...]:
    return (*dims[:-2], dims[-1], dims[-2]) if col and len(dims) >= 2 else dims
