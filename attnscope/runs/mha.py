"""`attnscope mha` between parsing and rendering: random or file inputs, the memory guard, the traced
MultiHeadAttention, the check against PyTorch, --save."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnscope import cost
from attnscope.errors import UsageError
from attnscope.runs.common import (
    AttentionOptions,
    RunResult,
    build_mask,
    check_addressable,
    check_common,
    check_heads,
    finish,
    flag_overhead,
    guard_files,
    guard_memory,
    inputs_bytes,
    load,
    param_bytes,
)

if TYPE_CHECKING:
    from attnscope.check import Comparison


@dataclass
class MhaOptions(AttentionOptions):
    batch: int = 128
    nq: int = 32
    nk: int | None = None
    d_feat: int = 200
    heads: int = 5
    bias: bool = True
    dropout: float = 0.0


def run_mha(o: MhaOptions) -> RunResult:
    _check_mha_options(o)
    cross = o.nk is not None and o.nk != o.nq
    n_K = o.nk if o.nk is not None else o.nq
    masked = bool(o.causal or o.pad or o.mask)
    if not o.q:
        needed = cost.mha_bytes(o.batch, o.nq, n_K, o.d_feat, o.heads, bias=o.bias, cross=cross, masked=masked)
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
    device = "meta" if o.meta else "cpu"
    dtype_note = None
    if Q is not None and Q.dim() != 3:  # before reading d_feat from it: the rank is what is wrong
        raise UsageError(f"--q {o.q} is {list(Q.shape)} but multi-head attention takes [n_batch, n, d_feat]")
    if Q is not None and Q.shape[-1] == 0:
        raise UsageError(f"--q {o.q} is {list(Q.shape)}: d_feat = 0, so there are no features to project; "
                         "give each token at least one feature")
    d_feat = int(Q.shape[-1]) if Q is not None else o.d_feat
    check_heads(d_feat, o.heads, from_file=Q is not None)
    if Q is None:
        generator = torch.Generator().manual_seed(o.seed) if not o.meta else None
        Q = torch.randn(o.batch, o.nq, d_feat, generator=generator, device=device)
        K = torch.randn(o.batch, n_K, d_feat, generator=generator, device=device) if cross else Q
        V = torch.randn(o.batch, n_K, d_feat, generator=generator, device=device) if cross else Q
    else:
        from attnscope.attention import common_dtype

        K = Q if K is None else K
        V = K if V is None else V
        dtype, dtype_note = common_dtype(Q, K, V)  # integers -> float32, mixed floats -> the wider one
        Q, K, V = (t.to(dtype) for t in (Q, K, V))
        if o.meta:
            Q, K, V = Q.to("meta"), K.to("meta"), V.to("meta")
    n_batch = int(Q.shape[0]) if Q.dim() == 3 else 0
    n_Q, n_K = (int(Q.shape[1]), int(K.shape[1])) if Q.dim() == 3 and K.dim() == 3 else (0, 0)
    mask = build_mask(o, user_mask, n_Q, n_K, device) if n_Q else None

    with torch.no_grad():
        if o.q and not o.meta:  # file inputs: the estimate needs their shapes, so it comes after loading
            shadow = MultiHeadAttention(d_feat, o.heads, bias=o.bias, device="meta", dtype=Q.dtype)
            estimate = shadow(Q.to("meta"), K.to("meta"), V.to("meta"),
                              mask.to("meta") if mask is not None else None)
            needed = cost.traced_peak_bytes(estimate.steps, inputs_bytes(Q, K, V, mask) + param_bytes(shadow))
            guard_memory(needed + flag_overhead(o, needed), o.max_memory)
        torch.manual_seed(o.seed)
        # the weights take the inputs' dtype: a float64 file runs in float64, as sdpa does
        module = MultiHeadAttention(d_feat, o.heads, bias=o.bias, dropout_p=o.dropout, device=device, dtype=Q.dtype)
        module.train(o.dropout > 0)  # dropout is applied only when asked for
        trace = module(Q, K, V, mask)
        if o.q and dtype_note:
            trace.notes.append(dtype_note)

    comparisons: list[Comparison] = []
    if o.check:
        from attnscope import check

        comparisons = check.check_mha(module, trace, Q, K, V, mask)

    extra = inputs_bytes(Q, K, V, mask) + param_bytes(module)
    params: dict[str, Any] = {"batch": n_batch, "nq": n_Q, "nk": n_K, "d_feat": d_feat, "heads": o.heads,
                              "d_head": module.d_head, "bias": o.bias, "dropout": o.dropout, "seed": o.seed,
                              "causal": o.causal, "pad": o.pad, "mask": o.mask, "meta": o.meta,
                              "inputs": {n: s for n, s in (("Q", o.q), ("K", o.k), ("V", o.v)) if s} or "random"}
    kind = "cross-attention" if K is not Q else "self-attention"
    header = (f"MHA ({kind})  x = W_o(merge_heads(softmax(Q_split K_splitᵀ / √d_head) V_split))\n"
              f"n_batch={n_batch}  n_Q={n_Q}  n_K={n_K}  d_feat={d_feat}  n_head={o.heads}  "
              f"d_head={module.d_head}  seed={o.seed}")
    result = RunResult("mha", header, params, trace, cost.traced_peak_bytes(trace.steps, extra),
                       cost.fused_peak_bytes(trace.steps, extra), comparisons)
    return finish(o, result)


def _check_mha_options(o: MhaOptions) -> None:
    check_common(o)
    if not 0.0 <= o.dropout < 1.0:
        raise UsageError(f"--dropout {o.dropout:g} is outside [0, 1): it is the probability of zeroing a weight")
    if o.check and o.dropout > 0:
        raise UsageError("--check compares exact numbers and dropout makes them random; drop --dropout or --check")
    if not o.q:
        check_heads(o.d_feat, o.heads, from_file=False)
