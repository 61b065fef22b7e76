"""`attnscope mha` between parsing and rendering: random or file inputs, the memory guard, the traced
MultiHeadAttention, the check against PyTorch, --save."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnscope import cost
from attnscope.errors import UsageError
from attnscope.runs.common import (
    AttentionOptions,
    RunResult,
    asked,
    build_mask,
    check_addressable,
    check_common,
    check_heads,
    check_kv_heads,
    effective_causal,
    finish,
    finish_variants,
    flag_overhead,
    guard_files,
    guard_memory,
    input_op,
    inputs_bytes,
    load,
    mask_extra,
    param_bytes,
    random_inputs,
    rope_base,
    structural_bytes,
    variant_kwargs,
    variants_line,
)

if TYPE_CHECKING:
    import torch

    from attnscope.check import Comparison
    from attnscope.multihead import MultiHeadAttention
    from attnscope.runs.common import SavedExtra


@dataclass
class MhaOptions(AttentionOptions):
    batch: int = 128
    nq: int = 32
    nk: int | None = None
    d_feat: int = 200
    heads: int = 5
    bias: bool = True
    dropout: float = 0.0
    kv_heads: int | None = None  # grouped-query attention; 1 is multi-query
    d_head: int | None = None  # default d_feat / heads
    scale: float | None = None  # default 1 / sqrt(d_head)


def run_mha(o: MhaOptions) -> RunResult:
    _check_mha_options(o)
    cross = o.nk is not None and o.nk != o.nq
    n_new = o.nk if o.nk is not None else o.nq  # keys computed in this call; the cache holds o.cache more
    causal = effective_causal(o)
    if not o.q:
        n_K = o.cache + n_new
        needed = cost.mha_bytes(o.batch, o.nq, n_K, o.d_feat, o.heads, bias=o.bias, cross=cross,
                                masked=bool(causal or o.pad or o.mask), n_kv_head=o.kv_heads, d_head=o.d_head,
                                rope=o.rope, softcap=o.softcap is not None, alibi=o.alibi, cache=o.cache,
                                offset=n_K - o.nq if causal == "lower-right" else 0)
        if o.meta:
            check_addressable(needed)
        else:
            guard_memory(needed + flag_overhead(o, needed), o.max_memory)
    import torch

    from attnscope.multihead import MultiHeadAttention

    if not o.meta:
        guard_files([o.q, o.k, o.v, o.mask], o.max_memory)
    user_mask = load(o.mask, o.meta)  # with --meta, the headers only
    Q, K, V = load(o.q, o.meta), load(o.k, o.meta), load(o.v, o.meta)
    raw: dict[str, torch.Tensor | None] = {"Q": Q, "K": K, "V": V}
    device = "meta" if o.meta else "cpu"
    dtype_note = None
    if Q is not None and Q.dim() != 3:  # before reading d_feat from it: the rank is what is wrong
        raise UsageError(f"--q {o.q} is {list(Q.shape)} but multi-head attention takes [n_batch, n, d_feat]")
    if Q is not None and Q.shape[-1] == 0:
        raise UsageError(f"--q {o.q} is {list(Q.shape)}: d_feat = 0, so there are no features to project; "
                         "give each token at least one feature")
    d_feat = int(Q.shape[-1]) if Q is not None else o.d_feat
    check_heads(d_feat, o.heads, from_file=Q is not None, d_head=o.d_head)
    if Q is None:
        shapes = {"Q": (o.batch, o.nq, d_feat), **({"K": (o.batch, n_new, d_feat), "V": (o.batch, n_new, d_feat)}
                                                     if cross else {})}
        drawn = random_inputs(shapes, o.seed, device)
        Q, K, V = drawn["Q"], drawn.get("K", drawn["Q"]), drawn.get("V", drawn["Q"])
        raw = {"Q": Q, "K": K, "V": V}
    else:
        from attnscope.attention import common_dtype

        K = Q if K is None else K
        V = K if V is None else V
        raw = {"Q": Q, "K": K, "V": V}
        dtype, dtype_note = common_dtype(Q, K, V)  # integers -> float32, mixed floats -> the wider one
        Q, K, V = (t.to(dtype) for t in (Q, K, V))
        if o.meta:
            Q, K, V = Q.to("meta"), K.to("meta"), V.to("meta")
    n_batch = int(Q.shape[0]) if Q.dim() == 3 else 0
    n_Q, n_new = (int(Q.shape[1]), int(K.shape[1])) if Q.dim() == 3 and K.dim() == 3 else (0, 0)
    n_K = o.cache + n_new
    settings: dict[str, Any] = {"n_kv_head": o.kv_heads, "d_head": o.d_head, "scale": o.scale, **variant_kwargs(o)}
    mask = None
    if n_Q:
        scores = (n_batch, n_Q, n_K) if user_mask is not None and user_mask.dim() == 3 else (n_batch, o.heads, n_Q, n_K)
        mask = build_mask(o, user_mask, n_Q, n_K, device, scores_shape=scores)

    with torch.no_grad():
        if o.q and not o.meta:  # file inputs: the estimate needs their shapes, so it comes after loading
            shadow = MultiHeadAttention(d_feat, o.heads, bias=o.bias, device="meta", dtype=Q.dtype, **settings)
            estimate = shadow(Q.to("meta"), K.to("meta"), V.to("meta"), mask.to("meta") if mask is not None else None,
                              cache=_cache(o, shadow, n_batch, None, "meta"))
            needed = cost.traced_peak_bytes(estimate.steps, _held(o, Q, K, V, mask, shadow, n_Q, n_K))
            guard_memory(needed + flag_overhead(o, needed), o.max_memory)
        torch.manual_seed(o.seed)
        # the weights take the inputs' dtype: a float64 file runs in float64, as sdpa does
        module = MultiHeadAttention(d_feat, o.heads, bias=o.bias, dropout_p=o.dropout, device=device, dtype=Q.dtype,
                                    **settings)
        module.train(o.dropout > 0)  # dropout is applied only when asked for
        cache = _cache(o, module, n_batch, o.seed, device)
        trace = module(Q, K, V, mask, cache=cache)
        if o.q and dtype_note:
            trace.notes.append(dtype_note)

    comparisons: list[Comparison] = []
    if o.check:
        from attnscope import check

        Q_raw, K_raw, V_raw = check.as_float(*(t for t in (raw["Q"], raw["K"], raw["V"]) if t is not None))
        comparisons = check.check_mha(module, trace, Q_raw, K_raw, V_raw, user_mask, asked(o, o.scale), cache)
        note = check.input_note({**raw, "mask": user_mask})
        if note:
            trace.notes.append(note)

    params: dict[str, Any] = {"batch": n_batch, "nq": n_Q, "nk": n_K, "d_feat": d_feat, "heads": o.heads,
                              "d_head": module.d_head, "kv_heads": module.n_kv_head, "n_group": module.n_group,
                              "bias": o.bias, "dropout": o.dropout, "seed": o.seed, "scale": o.scale,
                              "causal": causal, "pad": o.pad, "mask": o.mask, "meta": o.meta, "window": o.window,
                              "softcap": o.softcap, "alibi": o.alibi, "rope": o.rope,
                              "rope_base": rope_base(o),
                              "cache": o.cache,
                              "inputs": {n: s for n, s in (("Q", o.q), ("K", o.k), ("V", o.v)) if s} or "random"}
    params["batch_shape"] = [n_batch]  # a list in every command's JSON, as sdpa's `batch` is
    kind = "cross-attention" if K is not Q else "self-attention"
    scaling = "/ √d_head" if o.scale is None else f"· {o.scale:g}"  # · 0 is allowed: uniform attention
    heads = f"n_head={o.heads}" if module.n_group == 1 else f"n_head={o.heads}  n_kv_head={module.n_kv_head}"
    header = (f"MHA ({kind})  x = W_o(merge_heads(softmax(Q_split K_splitᵀ {scaling}) V_split))\n"
              f"n_batch={n_batch}  n_Q={n_Q}  n_K={n_K}  d_feat={d_feat}  {heads}  "
              f"d_head={module.d_head}  seed={o.seed}") + variants_line(o, n_Q, n_K)
    extra = _held(o, Q, K, V, mask, module, n_Q, n_K)
    result = RunResult("mha", header, params, trace, cost.traced_peak_bytes(trace.steps, extra),
                       cost.fused_peak_bytes(trace.steps, extra), comparisons)
    result.kv_cache_bytes = cost.kv_cache_bytes(n_batch, module.n_kv_head, n_K, module.d_head, module.d_head,
                                                Q.element_size())
    finish_variants(o, result, n_Q, n_K, user_mask)
    return finish(o, result, saved_inputs(o, module, Q, K, V) | mask_extra(o, mask, n_Q, n_K))


def saved_inputs(o: MhaOptions, module: MultiHeadAttention, Q: torch.Tensor, K: torch.Tensor,
                 V: torch.Tensor) -> SavedExtra:
    """For --save: the inputs (K and V only where they differ from Q and K) and the module's parameters under
    their PyTorch names (`W_q.weight`, `W_q.bias`, ...), so the run can be checked by anyone again."""
    extra: SavedExtra = {}
    for name, tensor, spec, n, skip in (("Q", Q, o.q, "n_Q", None), ("K", K, o.k, "n_K", Q), ("V", V, o.v, "n_K", K)):
        if tensor is not skip:  # self-attention saves Q alone: K = V = Q
            extra[name] = (tensor, ("n_batch", n, "d_feat"), input_op(spec, f"torch.randn(n_batch, {n}, d_feat)"))
    for name, tensor in module.state_dict().items():
        linear = name.split(".")[0]
        dims = ("out_features", "in_features") if name.endswith("weight") else ("out_features",)
        extra[name] = (tensor, dims, f"{linear} = nn.Linear(in_features, out_features): its {name.split('.')[-1]}")
    return extra


def _cache(o: MhaOptions, module: Any, n_batch: int, seed: int | None, device: str) -> Any:
    """--cache N: random cached keys (taken as already rotated) and values, [n_batch, n_kv_head, N, d_head]."""
    if not o.cache:
        return None
    dtype = module.W_k.weight.dtype
    shape = (n_batch, module.n_kv_head, o.cache, module.d_head)
    drawn = random_inputs({"K_cache": shape, "V_cache": shape}, (seed or 0) + 1, device)
    return drawn["K_cache"].to(dtype), drawn["V_cache"].to(dtype)


def _held(o: MhaOptions, Q: Any, K: Any, V: Any, mask: Any, module: Any, n_Q: int, n_K: int) -> int:
    """What the run holds beside its steps: inputs, weights, the masks (the cache tensors are steps)."""
    return inputs_bytes(Q, K, V, mask) + param_bytes(module) + structural_bytes(o, n_Q, n_K)


def _check_mha_options(o: MhaOptions) -> None:
    check_common(o)
    if not 0.0 <= o.dropout < 1.0:
        raise UsageError(f"--dropout {o.dropout:g} is outside [0, 1): it is the probability of zeroing a weight")
    if o.check and o.dropout > 0:
        raise UsageError("--check compares exact numbers and dropout makes them random; drop --dropout or --check")
    check_kv_heads(o.heads, o.kv_heads)
    if o.scale is not None and not math.isfinite(o.scale):
        raise UsageError(f"--scale {o.scale}: the scores' scale must be a finite number")
    if o.cache and (o.k or o.v or (o.nk is not None and o.nk != o.nq)):
        raise UsageError("--cache is a decode step of self-attention (the new tokens' keys follow the cached ones); "
                         "drop --nk/--k/--v")
    if not o.q:
        check_heads(o.d_feat, o.heads, from_file=False, d_head=o.d_head)
