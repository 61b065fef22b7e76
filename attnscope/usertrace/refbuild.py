"""The reference built and run: attnscope's MultiHeadAttention holding the code's projections (`build_mha`), its
head widths read from theirs (`head_widths`), the code's own q and k norms' weights and forms where it normalizes
them (`_qk_norms`, normforms.py), and the runs of a module's reference (`run_mha`), of a function's (`run_sdpa`) and
of the column form (`run_columns`). reference.py gathers the reference's modules."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from attnscope.errors import UsageError
from attnscope.trace import Trace
from attnscope.usertrace import normforms
from attnscope.usertrace.linearweights import ROLES, mentioned, role_of
from attnscope.usertrace.refspec import Spec

if TYPE_CHECKING:
    from attnscope.usertrace.projections import Projections
    from attnscope.usertrace.record import Record


def build_mha(found: Projections, n_head: int, spec: Spec = Spec(), module: nn.Module | None = None,
              records: list[Record] | None = None) -> nn.Module:
    """attnscope's MultiHeadAttention holding the user's weights (biases a layer lacks are zero), computing
    what `spec` describes."""
    from attnscope.attention.multihead import MultiHeadAttention

    q, k, v, o = (found.linears[role][1] for role in ROLES)
    d_feat = q.in_features
    names = {role: found.linears[role][0] for role in ROLES}
    # K and V may each read their own width (a context's; MobileBERT's values the full hidden_size beside its
    # bottlenecked queries and keys); the output projection may write another than the queries read (Zamba's
    # shared block reads cat(hidden, embeddings), 2·d_model, and writes d_model back): held as it is, below
    d_head, n_kv_head, d_v = head_widths(names, (q, k, v, o), n_head)
    if spec.rope_base is not None and d_head % 2:
        raise UsageError(f"RoPE rotates pairs of coordinates, so d_head must be even; it is {d_head}")
    qkv_bias = any(m.bias is not None for m in (q, k, v))
    weight = q.weight
    norms = _qk_norms(module, spec, n_head, n_kv_head, d_head, records) if module is not None else {}
    attention = spec.attention(n_kv_head)
    forms: dict[str, Any] = {}
    if not norms and attention.norm is not None and spec.qk_norm_eps is not None:  # a norm without weights
        attention = replace(attention, qk_norm=replace(attention.norm, eps=float(spec.qk_norm_eps)))
    if norms and attention.norm is not None:  # the user's norm's epsilon (nn.RMSNorm's None: its dtype's eps), kind
        forms = _norm_forms(norms, attention.norm, n_head, n_kv_head, d_head)
        if forms:  # read by experiment on the user's own norms (normforms.py): kind, (1 + w), eps, weights
            form = forms["q"]
            attention = replace(attention, qk_norm=replace(attention.norm, eps=float(form.eps), kind=form.kind,
                                                            offset=form.offset))
        else:
            eps = getattr(norms["q"][1], "eps", None)
            eps = torch.finfo(weight.dtype).eps if eps is None else eps
            kind = "layer" if _is_layer_norm(norms["q"][1]) else "rms"
            attention = replace(attention, qk_norm=replace(attention.norm, eps=float(eps), kind=kind))
    reference = MultiHeadAttention(d_feat, n_head, bias=qkv_bias, out_bias=o.bias is not None,
                                   d_head=d_head if d_head * n_head != d_feat else None, device=weight.device,
                                   dtype=weight.dtype, spec=attention,
                                   d_kv_in=k.in_features if k.in_features != d_feat else None,
                                   d_v_in=v.in_features if v.in_features != k.in_features else None,
                                   d_v=d_v if d_v != d_head else None)
    if o.out_features != d_feat:  # another width than d_feat (a merge's identity, Zamba's o_proj): held as it is
        reference.W_o = nn.Linear(o.in_features, o.out_features, bias=o.bias is not None, device=weight.device,
                                  dtype=weight.dtype)
    with torch.no_grad():
        for mine, theirs in ((reference.W_q, q), (reference.W_k, k), (reference.W_v, v), (reference.W_o, o)):
            mine.weight.copy_(theirs.weight)
            if mine.bias is not None:
                mine.bias.copy_(theirs.bias if theirs.bias is not None else torch.zeros_like(mine.bias))
        if spec.sinks is not None and reference.sinks is not None:  # the module's own sinks (sinkcols.py)
            reference.sinks.copy_(spec.sinks.reshape(-1).to(reference.sinks.dtype))
        if not norms and attention.norm is not None and spec.qk_norm_gain is not None:
            reference.q_norm.weight.fill_(spec.qk_norm_gain)
            reference.k_norm.weight.fill_(spec.qk_norm_gain)
        for role, (_, norm) in norms.items():
            mine = getattr(reference, f"{role}_norm")
            theirs, bias = (forms[role].weight, forms[role].bias) if forms else \
                (normforms.weight_of(norm, mine.weight.shape[-1]), getattr(norm, "bias", None))
            if theirs is None:  # a norm whose weight is not read: the reference's unit weight
                continue
            if theirs.numel() != mine.weight.numel():  # a row per head: [heads, 1, d_head] over [.., heads, n, d_head]
                mine.weight = nn.Parameter(theirs.reshape(-1, 1, mine.weight.shape[-1]).clone())
                if mine.bias is not None:
                    mine.bias = nn.Parameter(torch.zeros_like(mine.weight))
            mine.weight.copy_(_as_held(theirs, mine.weight))
            if mine.bias is not None:  # a LayerNorm's (nn.LayerNorm(bias=False) has none: zeros)
                mine.bias.copy_(_as_held(bias, mine.bias) if bias is not None else torch.zeros_like(mine.bias))
    reference.strided_heads = spec.strided_heads
    return reference.eval()


def head_widths(names: dict[str, str], linears: tuple[Any, Any, Any, Any], n_head: int) -> tuple[int, int, int]:
    """(d_head, n_kv_head, d_V) from the projections' widths: q writes n_head·d_head (d_head = d_K, the queries' and
    keys' per head), k n_kv_head·d_head, v n_kv_head·d_V and o reads n_head·d_V. The values may be as wide as the keys
    or not (Perceiver IO's v_channels, DeepSeek's v_head_dim beside d_nope + d_rope); a layout these do not fit is
    refused, naming the width that does not."""
    q, k, v, o = linears
    if q.out_features % n_head:
        raise UsageError(f"{names['q']} writes {q.out_features} features, which {n_head} heads do not split evenly; "
                         "a multi-head layout needs q.out = n_head·d_head")
    d_head = q.out_features // n_head
    if k.out_features % d_head:
        raise UsageError(f"{names['k']} writes {k.out_features} features, not a whole number of heads of d_head = "
                         f"{d_head} ({names['q']}'s {q.out_features} over {n_head} heads): queries and keys need one "
                         "width per head")
    n_kv_head = k.out_features // d_head
    if n_head % n_kv_head:
        raise UsageError(f"{n_head} query heads cannot share {n_kv_head} key/value heads evenly")
    if v.out_features % n_kv_head or o.in_features % n_head \
            or v.out_features // n_kv_head != o.in_features // n_head:
        raise UsageError(f"{names['v']} writes {v.out_features} features and {names['o']} reads {o.in_features}: "
                         f"not one value width per head over {n_kv_head} key/value heads and {n_head} query heads "
                         "(a multi-head layout needs v.out = n_kv_head·d_V and o.in = n_head·d_V)")
    return d_head, n_kv_head, v.out_features // n_kv_head


def _qk_norms(module: nn.Module, spec: Spec, n_head: int, n_kv_head: int, d_head: int,
              records: list[Record] | None = None) -> dict[str, tuple[str, Any]]:
    """With --qk-norm, the user's q and k norms whose weights the reference takes: modules with a 1-D `weight` as
    wide as the norm (d_head per head, the projection's width over it) that the run reads (`records`: diffusers'
    Attention holds norm_added_q and norm_added_k beside norm_q and norm_k, for a context its self-attention never
    gets), by name (`q_norm`, `k_norm`), else the only two in registration order; none found: unit weights. An
    nn.LayerNorm (timm's default norm_layer: the mean taken out, a bias) makes the reference's qk-norm a LayerNorm;
    another norm with a bias, or q and k normed by different kinds, is refused in one line."""
    if spec.qk_norm is None:
        return {}
    widths = {"q": d_head, "k": d_head} if spec.qk_norm == "head" else {"q": n_head * d_head, "k": n_kv_head * d_head}
    # per head, a weight row for each (Cohere's [n_head, d_head]) or one that every head shares
    rows = {"q": (1, n_head), "k": (1, n_kv_head)} if spec.qk_norm == "head" else {"q": (1,), "k": (1,)}
    found = [(name, m) for name, m in module.named_modules()  # a ModuleList of norms holds them, and is none
             if m is not module and not isinstance(m, (nn.Linear, nn.ModuleList, nn.ModuleDict))
             and _gain(m, widths.values(), {*rows["q"], *rows["k"]}) is not None]
    if records:  # the norms the run used (their weights read by an op, or the module called on a tensor)
        found = _run_norms(found, records)
    if records and spec.qk_norm == "head":  # a norm per head, each on its own head's slice (headnorms.py)
        from attnscope.usertrace import headnorms

        found = headnorms.group(found, records, {*rows["q"], *rows["k"]} - {1}, d_head, module, role_of)
    if records and not found:  # gains the module holds itself, `F.rms_norm(q, (d,)) * self.q_gain` (baregains.py)
        from attnscope.usertrace import baregains

        found = baregains.read(module, records, set(widths.values()))
    by_role = {role: [(n, m) for n, m in found if role_of(n.replace("norm", "")) == role] for role in ("q", "k")}
    if all(len(by_role[r]) == 1 for r in ("q", "k")):
        norms = {r: by_role[r][0] for r in ("q", "k")}
    elif len(found) == 2:
        norms = dict(zip(("q", "k"), found, strict=True))
    else:
        return {}
    for role, (name, norm) in norms.items():
        if _gain(norm, (widths[role],), rows[role]) is None:
            return {}
        if not _is_layer_norm(norm) and getattr(norm, "bias", None) is not None \
                and getattr(normforms.read(norm, widths[role]), "kind", None) != "layer":  # a LayerNorm by hand
            raise UsageError(f"your {name} is a {type(norm).__name__} with a bias, which the reference's qk-norm "
                             "reads only as nn.LayerNorm's (timm's default norm_layer) or an RMSNorm's weight alone "
                             "(Qwen3, OLMo 2, Gemma 3), so it cannot describe yours")
    (q_name, q_norm), (k_name, k_norm) = norms["q"], norms["k"]
    q_form, k_form = (normforms.read(norm, widths[role]) for role, (_, norm) in norms.items())
    kinds = (q_form.kind, k_form.kind) if q_form is not None and k_form is not None else \
        (_is_layer_norm(q_norm), _is_layer_norm(k_norm))
    if kinds[0] != kinds[1]:
        raise UsageError(f"your {q_name} is a {type(q_norm).__name__} and your {k_name} a {type(k_norm).__name__}; "
                         "the reference normalizes q and k with one kind of norm, LayerNorm or RMSNorm")
    return norms


def _run_norms(found: list[tuple[str, Any]], records: list[Record]) -> list[tuple[str, Any]]:
    """Of the norms `found`, those the run used, and beside them those of a role (q or k, by name) no used one holds:
    a code that leaves one side unnormed (`k_norm` never called) still holds that side's norm, whose weights the
    reference takes (else it reads one norm, and normalizes with unit weights). Two norms found and one used: both."""
    used = [(name, m) for name, m in found if _used(name, m, records)]
    if not used:
        return found
    if len(used) == 1 and len(found) == 2:
        return found
    held = {_norm_role(name) for name, _ in used}
    return used + [(name, m) for name, m in found if all(m is not u for _, u in used)
                   and _norm_role(name) in ("q", "k") and _norm_role(name) not in held]


def _norm_role(name: str) -> str | None:
    """q or k as a norm's name says, or the nearest module above it whose name does (`k_layernorm.norms.1`:
    StableLM's norm per head held in its StableLmLayerNormPerHead's list)."""
    parts = name.split(".")
    return next((role for i in range(len(parts), 0, -1)
                 for role in (role_of(".".join(parts[:i]).replace("norm", "")),) if role is not None), None)


def _used(name: str, norm: nn.Module, records: list[Record]) -> bool:
    """Whether any op of the run read one of the norm's parameters (`x * norm_q.weight`, `F.rms_norm(..,
    weight=norm_q.weight)`, a weight cast first: `norm_q.weight.to(x.dtype)`)."""
    held = {f"{name}.{p}" for p, _ in norm.named_parameters()}
    return any(mentioned(p, records) for p in held)


def _as_held(value: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """A weight or bias as the reference's norm holds it: a row per head `[heads, d_head]` as `[heads, 1, d_head]`;
    one that every head shares as it is (copy_ repeats it)."""
    return value.reshape(held.shape) if value.numel() == held.numel() else value


def _gain(norm: nn.Module, widths: Any, rows: Any) -> torch.Tensor | None:
    """A norm's weight over one of `widths` (its largest parameter of such a width, whatever it is called: `scale`,
    `gain`; normforms.shaped): 1-D, or one row per head (`[n_head, d_head]`, `[n_head, 1, d_head]`) for one of
    `rows` (the head counts). None where it holds none."""
    for width in dict.fromkeys(widths):
        weight = normforms.shaped(norm, width)
        if weight is not None and weight.numel() // width in rows:
            return weight
    return None


def _norm_forms(norms: dict[str, tuple[str, Any]], norm: Any, n_head: int, n_kv_head: int,
                d_head: int) -> dict[str, Any]:
    """The forms the user's q and k norms compute (normforms.read: RMSNorm or LayerNorm, w or Gemma's 1 + w, eps),
    read by running each on a probe; empty where either is not read, or the two read as different kinds, or with
    their weights offset differently (the reference's one qk-norm cannot hold them)."""
    widths = {"q": norm.width(n_head, d_head), "k": norm.width(n_kv_head, d_head)}
    forms = {role: normforms.read(module, widths[role]) for role, (_, module) in norms.items()}
    q, k = forms.get("q"), forms.get("k")
    if q is None or k is None or q.kind != k.kind or q.offset != k.offset:
        return {}
    return forms


def _is_layer_norm(norm: nn.Module) -> bool:
    """nn.LayerNorm (timm's `Attention(qk_norm=True)` default, and its subclasses: timm's own LayerNorm)."""
    return isinstance(norm, nn.LayerNorm)


def run_mha(reference: nn.Module, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
            mask: torch.Tensor | None, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
            position_bias: torch.Tensor | None = None) -> Trace:
    with torch.no_grad():
        trace: Trace = reference(Q, K, V, mask, cache=cache, position_bias=position_bias)
    return trace


def run_sdpa(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None,
             spec: Spec = Spec()) -> Trace:
    from attnscope.attention.dot_product import sdpa
    from attnscope.usertrace.keytable import run_keyed

    gqa = Q.dim() >= 3 and K.dim() >= 3 and Q.shape[-3] != K.shape[-3]

    def run(bias: torch.Tensor | None) -> Trace:
        with torch.no_grad():
            return sdpa(Q, K, V, mask, enable_gqa=gqa, spec=spec.attention(), position_bias=bias, sinks=spec.sinks)

    return run_keyed(run, spec, Q.shape[-1])


def run_columns(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None,
                spec: Spec = Spec()) -> Trace:
    """The column form on inputs [.., d, n]: `attnscope sdpa --layout col`'s textbook.sdpa_columns, its mask
    ([.., n_K, n_Q], True = may attend) the file's and the causal/window mask transposed, as sdpa's build_mask
    transposes them for the column layout."""
    from attnscope import masks
    from attnscope.attention.textbook import sdpa_columns
    from attnscope.spec import AttentionSpec

    asked = AttentionSpec.asked(spec.causal, spec.window, window_side=spec.window_side)
    structural, _ = masks.structural(asked, Q.shape[-1], K.shape[-1])
    # [n_Q, n_K] -> the column form's [n_K, n_Q]
    combined = masks.combine(structural.transpose(-2, -1) if structural is not None else None, mask)
    with torch.no_grad():
        return sdpa_columns(Q, K, V, combined)
