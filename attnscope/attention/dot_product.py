"""Scaled dot-product attention, recorded step by step, with the variants of today's models.

`sdpa()` is a pure function that returns a `Trace`; `MultiHeadAttention` (multihead.py) calls it for
its inner step, so the two can never drift apart. The stages it shares with every form (qk-norm, RoPE, the
temperature, repeat KV) are stages.py's. Nothing here prints or imports a terminal library.

Steps, in order, each only when its option asks for it:
`Q, K, V, [Q_normed, K_normed], [cos, sin, Q_rot, K_rot], [attn_scales, Q_tuned], [K_rep, V_rep], scores,
[capped_scores], [alibi_bias | position_bias, biased_scores], [masked_scores], [sinks], attention,
[sink_weight], out` (sinks: sinks.py; qk-norm: qknorm.py; a position bias: position_bias.py).

Half precision: for float16/bfloat16 inputs the scores, the softmax and `attention @ V` are computed in
float32 and `out` is cast back, as PyTorch's math path does (`_scaled_dot_product_attention_math` upcasts
query, key and value); the steps' dtypes say so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from attnscope import cost, masks
from attnscope.attention import sinks as sinks_
from attnscope.attention.position_bias import add_position_bias
from attnscope.attention.stages import (
    HALF,
    Names,
    attend,
    dtype_name,
    half_note,
    leading_names,
    normalize,
    rotate,
    tune,
)
from attnscope.errors import UsageError
from attnscope.spec import AttentionSpec
from attnscope.trace import Trace
from attnscope.words import counted

if TYPE_CHECKING:
    from torch import Tensor

    from attnscope.variants.qknorm import QkNorm
    from attnscope.variants.rope import Rope
    from attnscope.variants.temperature import TemperatureTuning

__all__ = ["HALF", "HeadInputs", "Names", "add_position_bias", "dtype_name", "half_note", "leading_names", "sdpa",
           "sdpa_steps"]


@dataclass(frozen=True)
class HeadInputs:
    """What `sdpa` reads for one head of a module on a sequence, once the module has applied its own stages
    (projection, qk-norm, RoPE, temperature): Q `[n_batch, 1, n_Q, d_K]`, K `[n_batch, 1, n_K, d_K]`, V
    `[n_batch, 1, n_K, d_V]`, the `spec` of what is left for sdpa (the mask, softcap, sinks, scale...) and the
    head's sink logit (`[1]`, None without sinks). A block of its query rows is `sdpa(Q[..., a:b, :], K', V',
    spec=spec.rows_from(a), sinks=sinks)`, K' the keys those rows may see (models/forward/long.py)."""

    Q: Tensor
    K: Tensor
    V: Tensor
    spec: AttentionSpec
    sinks: Tensor | None = None


def batch_names(n: int) -> tuple[str, ...]:
    """Leading axes: `n_batch`; `n_batch, n_head` for two (PyTorch's `[N, H, L, E]`); with more, the last is
    `n_head` and the others `n_batch_1, n_batch_2, ...`."""
    if n <= 2:
        return ("n_batch", "n_head")[:n]
    return (*(f"n_batch_{i + 1}" for i in range(n - 1)), "n_head")


def common_dtype(*tensors: Tensor) -> tuple[torch.dtype, str | None]:
    """The dtype of the inputs once made alike, and a note when they had to be converted."""
    if all(t.is_floating_point() for t in tensors):
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        mixed = len({t.dtype for t in tensors}) > 1
        return dtype, (f"inputs of different dtypes were computed in {dtype_name(dtype)}" if mixed else None)
    found = sorted({dtype_name(t.dtype) for t in tensors if not t.is_floating_point()})
    return torch.float32, f"integer inputs ({', '.join(found)}) were computed in float32"


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where scores and softmax are computed: float32 for half precision, else the inputs' dtype."""
    return torch.float32 if dtype in HALF else dtype


def check_qkv(Q: Tensor, K: Tensor, V: Tensor, layout: str = "row", enable_gqa: bool = False) -> tuple[int, ...]:
    """Validate shapes and return the broadcast batch shape. Row layout: `[.., n, d]`; column: `[.., d, n]`.
    With `enable_gqa`, K and V may have fewer heads (axis -3) than Q, a divisor of Q's."""
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if t.dim() < 2:
            raise UsageError(
                f"{name} has rank {t.dim()} (shape {list(t.shape)}); attention needs rank 2 or more: "
                + ("[.., n, d]" if layout == "row" else "[.., d, n]")
            )
    d_axis, n_axis = (-1, -2) if layout == "row" else (-2, -1)
    if Q.shape[d_axis] != K.shape[d_axis]:
        raise UsageError(
            f"d_Q = {Q.shape[d_axis]} but d_K = {K.shape[d_axis]}: queries and keys are compared by a dot product, "
            f"so they need the same feature size (Q {list(Q.shape)}, K {list(K.shape)})"
        )
    if Q.shape[d_axis] == 0:
        raise UsageError(
            f"d_K = 0 (Q {list(Q.shape)}, K {list(K.shape)}): queries and keys have no features, so every score "
            "would be an empty dot product; give them at least one feature"
        )
    if K.shape[n_axis] != V.shape[n_axis]:
        raise UsageError(
            f"n_K = {K.shape[n_axis]} but n_V = {V.shape[n_axis]}: every key needs its value "
            f"(K {list(K.shape)}, V {list(V.shape)})"
        )
    k_batch, v_batch = list(K.shape[:-2]), list(V.shape[:-2])
    if enable_gqa and gqa_group(Q, K, V) > 1:
        k_batch[-1] = v_batch[-1] = Q.shape[-3]  # K_rep, V_rep have Q's heads
    try:
        return cost.broadcast_shapes(Q.shape[:-2], k_batch, v_batch)
    except ValueError:
        hint = ""
        if Q.dim() >= 3 and K.dim() >= 3 and Q.shape[-3] != K.shape[-3] and not enable_gqa:
            hint = "; for grouped-query attention (fewer K/V heads than Q heads) pass enable_gqa=True"
        raise UsageError(
            f"the batch dims of Q {list(Q.shape[:-2])}, K {list(K.shape[:-2])} and V {list(V.shape[:-2])} "
            f"do not broadcast; make them equal or 1{hint}"
        ) from None


def gqa_group(Q: Tensor, K: Tensor, V: Tensor) -> int:
    """n_group = n_head / n_kv_head: how many query heads share one K/V head (axis -3), as
    `F.scaled_dot_product_attention(enable_gqa=True)` requires; 1 when the heads are equal."""
    if Q.dim() < 3 or K.dim() < 3 or V.dim() < 3:
        return 1
    n_head, n_kv_head = Q.shape[-3], K.shape[-3]
    if V.shape[-3] != n_kv_head:
        raise UsageError(f"K has {counted(n_kv_head, 'head')} but V has {V.shape[-3]}; every key head needs its value "
                         "head")
    if n_head == n_kv_head:
        return 1
    if n_kv_head == 0 or n_head % n_kv_head:
        raise UsageError(f"Q has {counted(n_head, 'head')} and K/V have {n_kv_head}: grouped-query attention needs the "
                         f"query heads to be a multiple of the key/value heads")
    return n_head // n_kv_head


def resolve_spec(spec: AttentionSpec | None, **asked: Any) -> AttentionSpec:
    """`spec` itself, or one built (and so checked) from the keywords; never both, which could disagree."""
    if spec is None:
        return AttentionSpec(**{name: value for name, value in asked.items() if value is not None})
    given = [name for name, value in asked.items() if value not in (None, False)]
    if given:
        raise UsageError(f"give the attention either as spec=AttentionSpec(...) or as keywords, not both "
                         f"({', '.join(given)} given beside spec)")
    return spec


@dataclass(frozen=True)
class Prologue:
    """Q, K and V as every form of sdpa starts from them: checked, cast to one dtype, recorded as inputs."""

    trace: Trace
    Q: Tensor
    K: Tensor
    V: Tensor
    batch_dims: tuple[str, ...]
    dtype: torch.dtype  # the inputs' common dtype
    acc: torch.dtype  # the dtype the scores are computed in (float32 for half precision)
    n_group: int  # query heads per key/value head (grouped-query attention); 1 without


def prologue(Q: Tensor, K: Tensor, V: Tensor, names: Names, *, layout: str = "row",
             enable_gqa: bool = False, note_half: bool = True) -> Prologue:
    """What sdpa and textbook.sdpa_columns do first: check Q, K, V (`layout` "row": `[.., n, d]`, "col":
    `[.., d, n]`), name their batch dims, cast them to their common dtype, and start the trace with the dtype's
    notes (the half-precision one where `note_half`: sdpa's stages.attend says it) and the three inputs."""
    batch = check_qkv(Q, K, V, layout=layout, enable_gqa=enable_gqa)
    n_group = gqa_group(Q, K, V) if enable_gqa else 1
    batch_dims = names.batch if names.batch is not None else batch_names(len(batch))
    dtype, dtype_note = common_dtype(Q, K, V)
    acc = accumulate_dtype(dtype)
    Q, K, V = Q.to(dtype), K.to(dtype), V.to(dtype)
    trace = Trace()
    trace.notes.extend(note for note in (dtype_note, half_note(dtype) if acc != dtype and note_half else None) if note)
    kv_dims = batch_dims if n_group == 1 else (*batch_dims[:-1], "n_kv_head")
    axes = {"Q": ("n_Q", names.d_K), "K": ("n_K", names.d_K), "V": ("n_K", names.d_V)}
    for step, x, dims in (("Q", Q, batch_dims), ("K", K, kv_dims), ("V", V, kv_dims)):
        trace.add(getattr(names, step), x, (*leading_names(dims, x.dim()), *axes[step][::-1 if layout == "col" else 1]),
                  "input")
    return Prologue(trace, Q, K, V, batch_dims, dtype, acc, n_group)


def sdpa(
    Q: Tensor,
    K: Tensor,
    V: Tensor,
    mask: Tensor | None = None,
    scale: float | None = None,
    *,
    causal: bool | str | None = False,
    window: int | None = None,
    window_side: str | None = None,
    softcap: float | None = None,
    alibi: bool = False,
    rope: Rope | None = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    names: Names | None = None,
    spec: AttentionSpec | None = None,
    chunk: int | None = None,
    temperature: TemperatureTuning | None = None,
    position_bias: Tensor | None = None,
    sinks: Tensor | None = None,
    qk_norm: str | QkNorm | None = None,
) -> Trace:
    """Scaled dot-product attention: `out = softmax(Q Kᵀ · scale) V`, with `scale = 1/sqrt(d_K)` by default.

    Q `[.., n_Q, d_K]`, K `[.., n_K, d_K]`, V `[.., n_K, d_V]`, any leading batch dims that broadcast.
    `mask` is boolean (True = may attend), integer 0/1 (read as boolean) or float (added to the scores)
    and broadcasts to `[.., n_Q, n_K]`. A query that may attend to no key gets an output of zeros, as
    `F.scaled_dot_product_attention` gives.

    Variants: `causal` (True or "upper-left" as `is_causal=True`, or "lower-right"); `window` W, query i sees key j
    when j <= i and i - j < W (Mistral's; implies causal), or with `window_side="both"` when |i - j| <= W // 2 and
    no causal mask (ModernBERT's local attention, W its `local_attention`); `softcap` C, `capped_scores =
    C·tanh(scores/C)` (Gemma 2); `alibi`, a per-head linear bias (the head axis is -3; inputs without one are one
    head); `rope`, rotary embeddings of Q and K (query i at position i + offset, key j at j); `enable_gqa`, K and V
    with fewer heads than Q, shared by groups of query heads as `F.scaled_dot_product_attention(enable_gqa=True)`.
    `chunk` C, query i sees key j when j <= i and j // C == i // C (Llama 4's chunked attention; implies causal);
    `temperature`, Llama 4's per-query scale `log1p(floor((i + 1) / floor_scale)) · attn_scale + 1` on Q (after
    RoPE; temperature.py). Lower-right alignment puts query i at position `i + n_K - n_Q` for the mask, RoPE,
    ALiBi and the temperature alike.
    `sinks`, one logit per head `[n_head]`, joins each softmax row and is dropped after (GPT-OSS; sinks.py).
    `qk_norm="head"`: the unit-weight RMSNorm of Q and K over d_K before RoPE (Qwen3's q_norm/k_norm without
    their weights; qknorm.py).
    `spec` says all of these at once (an `AttentionSpec`, spec.py), in place of `scale` and the keywords.
    `position_bias`, a float tensor that broadcasts to the scores, is added to them as its own step (T5's
    relative position bias; position_bias.py).
    """
    names = names or Names()
    spec = resolve_spec(spec, scale=scale, causal=causal, window=window, softcap=softcap, alibi=alibi, rope=rope,
                        chunk=chunk, temperature=temperature, window_side=window_side, qk_norm=qk_norm)
    spec = sinks_.resolve(spec, sinks)
    rope = spec.rope
    if spec.norm is not None and spec.norm.over != "head":
        raise UsageError(f"{{qk_norm}} {spec.norm.over}: sdpa has no projection to normalise before a split; use "
                         "'head' (over d_K), or MultiHeadAttention for OLMo 2's norm over the projection", "qk_norm")
    inputs = prologue(Q, K, V, names, enable_gqa=enable_gqa, note_half=False)
    trace, Q, K, V = inputs.trace, inputs.Q, inputs.K, inputs.V
    n_Q, n_K = Q.shape[-2], K.shape[-2]
    q_name, k_name = names.Q, names.K

    offset = spec.offset(n_Q, n_K)
    late = spec.norm is not None and spec.norm.after_rope and rope is not None  # on the rotated heads (nGPT's)
    if spec.norm is not None and not late:
        Q, K = normalize(trace, Q, K, spec.norm, (None, None), source=(q_name, k_name),
                         dims=(trace.step(q_name).dims, trace.step(k_name).dims), axis=(names.d_K, names.d_K))
        q_name, k_name = "Q_normed", "K_normed"
    if rope is not None:
        Q, K = rotate(trace, Q, K, rope, q_offset=offset, k_offset=0, source=(q_name, k_name),
                      dims=(trace.step(q_name).dims, trace.step(k_name).dims), d_name=names.d_K, n_keys=n_K)
        q_name, k_name = "Q_rot", "K_rot"
    if late and spec.norm is not None:
        Q, K = normalize(trace, Q, K, spec.norm, (None, None), source=(q_name, k_name),
                         dims=(trace.step(q_name).dims, trace.step(k_name).dims), axis=(names.d_K, names.d_K))
        q_name, k_name = "Q_normed", "K_normed"
    if spec.temperature is not None:
        Q = tune(trace, Q, spec.temperature, start=offset, source=q_name, dims=trace.step(q_name).dims)
        q_name = "Q_tuned"
    # the mask is folded in once the scores are made, against their shape (stages.attend)
    built = masks.prepare(spec, n_Q, n_K, Q.device, mask)
    attend(trace, Q, K, V, built, replace(names, Q=q_name, K=k_name), n_group=inputs.n_group, sinks=sinks,
           dropout_p=dropout_p, position_bias=position_bias, bias_stage=add_position_bias,
           batch_dims=inputs.batch_dims, dtype=inputs.dtype)
    return trace


def sdpa_steps(trace: Trace, Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None, names: Names,
               spec: AttentionSpec, **options: Any) -> Tensor:
    """`sdpa` on the per-head Q, K, V a module made (projected, normed, rotated, the cache joined: already steps of
    `trace`, called `names`), its steps from `scores` on and its notes added to `trace`; the output back. A sink
    logit is the module's parameter, counted with its weights. `options`: sdpa's (enable_gqa, dropout_p,
    position_bias, sinks)."""
    inner = sdpa(Q, K, V, mask, names=names, spec=spec, **options)
    for step in inner.steps[3:]:  # from scores on: the inputs are already here
        if step.name == "sinks":  # the module's parameter, counted with its weights
            step = replace(step, op="the module's parameter sinks, one logit per head (held with the weights)",
                           allocates=False)
        trace.add_step(step)
    trace.notes.extend(inner.notes)
    return trace[names.out]
