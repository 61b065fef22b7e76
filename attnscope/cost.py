"""What a run costs: FLOPs per op, and the memory a traced or fused run needs.

Pure arithmetic on shapes, no torch, so the memory guard can run before anything is allocated.

Counting conventions (also in docs/performance.md):
- a matmul `[.., m, k] @ [.., k, n]` is `2·m·k·n` per batch element;
- a Linear `[.., n, d_in] -> [.., n, d_out]` is `2·n·d_in·d_out`, plus `n·d_out` for the bias;
- an element-wise op (scaling, masking, adding) is 1 per output element, a softmax 5 per element
  (max, subtract, exp, sum, divide); views, permutes and copies are 0;
- an RMSNorm (qk-norm) is 3 per element (square, sum, normalise) and 1 more for its weight, plus 3 per row
  (divide the sum, add eps, rsqrt).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnscope.spec import AttentionSpec

SOFTMAX_FLOPS_PER_ELEMENT = 5


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def matmul_flops(out_shape: Sequence[int], k: int) -> int:
    """FLOPs of a matmul whose output is `out_shape` (`[.., m, n]`) and whose inner size is `k`."""
    return 2 * numel(out_shape) * k


def linear_flops(out_shape: Sequence[int], d_in: int, bias: bool) -> int:
    return matmul_flops(out_shape, d_in) + (numel(out_shape) if bias else 0)


def softmax_flops(shape: Sequence[int]) -> int:
    return SOFTMAX_FLOPS_PER_ELEMENT * numel(shape)


def rms_norm_flops(shape: Sequence[int], weighted: bool) -> int:
    """An RMSNorm over the last axis of `shape`: 3 (4 with a weight) per element, 3 per row."""
    rows = numel(shape[:-1])
    return (3 + weighted) * numel(shape) + 3 * rows


def counted(kind: str, shape: Sequence[int], k: int = 0, extra: int = 0) -> int:
    """The FLOPs a step's `Cost` says (trace.py: recorded as data in the forward, counted when a table or the JSON
    asks): "linear" (`k` = d_in, `extra` 1 with a bias), "matmul" (`k` the summed axis, plus `extra` element-wise
    FLOPs), "softmax", "rms_norm" (`k` 1 with a weight, plus `extra`), each over the output `shape`."""
    if kind == "linear":
        return linear_flops(shape, k, bool(extra))
    if kind == "matmul":
        return matmul_flops(shape, k) + extra
    if kind == "softmax":
        return softmax_flops(shape)
    if kind == "rms_norm":
        return rms_norm_flops(shape, bool(k)) + extra
    raise ValueError(f"no FLOP count for {kind!r}")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str) -> int:
    """`8GB`, `512MiB`, `1.5g`, `1000000` -> bytes. Raises ValueError with a usable message."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 8GB, 512MiB or 1000000")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    base = 1024 if "i" in unit else 1000
    power = "kmgt".find(unit[:1]) + 1 if unit[:1] in "kmgt" and unit else 0
    return int(number * base**power) if power else int(number)


BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")
FLOP_UNITS = ((10**24, "Y"), (10**21, "Z"), (10**18, "E"), (10**15, "P"), (10**12, "T"), (10**9, "G"), (10**6, "M"),
              (10**3, "k"))


def format_bytes(n: int) -> str:
    """`1.5 KiB`, `2.0 PiB`: binary units, each 1024 times the one before, up to YiB."""
    size, unit = float(n), BYTE_UNITS[0]
    for unit in BYTE_UNITS:
        if abs(size) < 1024 or unit == BYTE_UNITS[-1]:
            break
        size /= 1024
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"


def format_flops(n: int) -> str:
    """`2.59 kFLOP`, `65.79 PFLOP`: decimal prefixes, up to YFLOP."""
    prefix, size = scale_count(n)
    return f"{size:.2f} {prefix}FLOP" if prefix else f"{n} FLOP"


def scale_count(n: int) -> tuple[str, float]:
    """The largest decimal prefix (k, M, G, T, P, E, Z, Y) that leaves at least 1, and `n` in it."""
    for size, prefix in FLOP_UNITS:
        if abs(n) >= size:
            return prefix, n / size
    return "", float(n)


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    """NumPy broadcasting of shapes; ValueError if they do not broadcast. (torch.broadcast_shapes would do,
    but it imports torch's symbolic-shape machinery, half a second of start-up for plain arithmetic.)"""
    rank = max((len(s) for s in shapes), default=0)
    result = [1] * rank
    for shape in shapes:
        for axis, size in enumerate(shape, start=rank - len(shape)):
            if size != 1 and result[axis] not in (1, size):
                raise ValueError(f"shapes {[list(s) for s in shapes]} do not broadcast")
            if size != 1:
                result[axis] = size
    return tuple(result)


def available_memory() -> int | None:
    """Bytes the machine can still give this process (MemAvailable on Linux), or None if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# Steps a fused kernel (F.scaled_dot_product_attention) never materializes.
ATTENTION_MATRICES = frozenset({"scores", "masked_scores", "attention"})


def traced_peak_bytes(steps: Sequence[object], extra: int = 0) -> int:
    """Memory of a traced run: every step stays alive in the trace, views add nothing, `extra` is the rest
    (module weights, inputs not recorded as steps, the mask)."""
    return extra + sum(s.nbytes for s in steps if s.allocates)  # type: ignore[attr-defined]


def fused_peak_bytes(steps: Sequence[object], extra: int = 0) -> int:
    """The same run through a fused kernel: no `[.., n_Q, n_K]` scores or attention, only a log-sum-exp per
    query row (float32) that flash-style kernels keep."""
    matrices = [s for s in steps if s.name in ATTENTION_MATRICES and s.allocates]  # type: ignore[attr-defined]
    lse = numel(matrices[0].shape[:-1]) * 4 if matrices else 0  # type: ignore[attr-defined]
    return traced_peak_bytes(steps, extra) - sum(s.nbytes for s in matrices) + lse  # type: ignore[attr-defined]


def sdpa_bytes(batch: int, n_Q: int, n_K: int, d_K: int, d_V: int, spec: AttentionSpec, *,
               itemsize: int = 4, user_mask: bool = False, pad: bool = False, bias: int = 0) -> int:
    """Peak bytes of a traced `sdpa` of `spec` on random inputs, from the sizes alone (no torch import): the guard
    must answer before torch has even loaded. tests/test_cost.py holds it equal to the meta-traced run.
    `user_mask`: a mask file (taken as one [n_Q, n_K] boolean), `pad`: key padding (`_masks` says what each holds).
    `bias`: the elements of a position bias (position_bias.py), which adds itself and biased_scores."""
    masked, offset = user_mask or pad or spec.structural, spec.offset(n_Q, n_K)
    softcap, alibi = spec.softcap is not None, spec.alibi
    inputs = batch * (n_Q * d_K + n_K * d_K + n_K * d_V)
    normed = batch * (n_Q + n_K) * d_K if spec.norm is not None else 0  # Q_normed, K_normed
    rotated = 0
    if spec.rope is not None:  # cos, sin [n_pos, d_rot] (the rotated width), Q_rot, K_rot (the whole head)
        rotated = 2 * _table_rows(n_Q, n_K, offset) * spec.rope.rotary_dim(d_K) + batch * (n_Q + n_K) * d_K
    tuned = batch * n_Q * d_K if spec.temperature is not None else 0  # Q_tuned
    # scores, [capped_scores], [biased_scores], [masked_scores], attention; alibi_bias is [1, n_Q, n_K]
    matrices = batch * n_Q * n_K * (2 + masked + softcap + alibi + bool(bias)) + (n_Q * n_K if alibi else 0) + bias
    # sinks: [1] (the inputs have one head), float32 as --sinks gives them; sink_weight [.., n_Q] a matrix's width
    sinks = 4 if spec.sinks else 0
    matrices += batch * n_Q if spec.sinks else 0
    return (itemsize * (inputs + normed + rotated + tuned + batch * n_Q * d_V) + accumulated(itemsize) * matrices
            + sinks + _masks(n_Q, n_K, spec, user_mask, pad) + _scales(spec, n_Q))


def accumulated(itemsize: int) -> int:
    """The bytes of an element of the scores, their biases, masked scores, the attention and the sinks' weight: a
    half-precision run computes them in float32 (dot_product.accumulate_dtype, as PyTorch's math path
    `_scaled_dot_product_attention_math` upcasts), any other in its own dtype. Counting them at 2 bytes made
    `bench --dtype bfloat16` estimate half of what CUDA measured (docs/performance.md)."""
    return 4 if itemsize == 2 else itemsize


def _masks(n_Q: int, n_K: int, spec: AttentionSpec, user_mask: bool, pad: bool) -> int:
    """The boolean masks a run holds, shared by the batch: the one built from the user's mask file and the key
    padding ([n_Q, n_K] with a file; padding alone is [1, n_K], a bool per key), and beside it the causal, window
    or chunk mask sdpa builds for the spec ([n_Q, n_K])."""
    users = n_Q * n_K if user_mask else n_K if pad else 0
    return users + (n_Q * n_K if spec.structural else 0)


def _table_rows(n_Q: int, n_K: int, offset: int) -> int:
    """The rows of RoPE's cos and sin tables: positions from min(0, offset) (negative lower-right when n_Q > n_K)
    to the last of the keys' and queries' (stages.rotate)."""
    return max(n_K, offset + n_Q) - min(0, offset)


def _scales(spec: AttentionSpec, n_Q: int) -> int:
    """attn_scales, one float32 factor per query (temperature tuning), whatever the inputs' dtype."""
    return 4 * n_Q if spec.temperature is not None else 0


def mha_bytes(batch: int, n_Q: int, n_K: int, d_feat: int, n_head: int, spec: AttentionSpec, *,
              itemsize: int = 4, bias: bool = True, cross: bool = False, user_mask: bool = False,
              pad: bool = False, d_head: int | None = None, position_bias: int = 0) -> int:
    """Peak bytes of a traced `MultiHeadAttention` of `spec` on random inputs: weights, inputs, Q/K/V_feat, the
    normed Q and K and their norms' weights, the rotated heads (cos and sin at the rotated width), the tuned
    queries, the cache and its concatenation, the repeated K/V heads, the per-head attention matrices, x_raw,
    x_rsh1 and x (the splits and x_rsh2 are views), and with sinks the module's `sinks` and the sink's weight per
    query. `n_K` counts every key, cached ones included (`spec.cache` of them). `position_bias`: the elements of
    a position bias, which adds biased_scores."""
    masked, offset, cache = user_mask or pad or spec.structural, spec.offset(n_Q, n_K), spec.cache
    softcap, alibi = spec.softcap is not None, spec.alibi
    n_kv_head = n_head if spec.n_kv_head is None else spec.n_kv_head
    d_head = d_feat // n_head if d_head is None else d_head
    q_width, kv_width = n_head * d_head, n_kv_head * d_head
    n_new = n_K - cache
    weights = d_feat * (2 * q_width + 2 * kv_width) + ((q_width + 2 * kv_width + d_feat) if bias else 0)
    inputs = batch * d_feat * (n_Q + 2 * n_new if cross else n_Q)
    feats = batch * (n_Q * q_width + 2 * n_new * kv_width)
    if spec.norm is not None:  # Q_normed, K_normed; q_norm.weight, k_norm.weight ([d_head] or as wide as W_q, W_k),
        # and a LayerNorm's biases as wide
        feats += batch * (n_Q * q_width + n_new * kv_width)
        weights += (2 * d_head if spec.norm.over == "head" else q_width + kv_width) * (2 if spec.norm.layer else 1)
    rotated = 0
    if spec.rope is not None:  # cos, sin at the rotated width; Q_rot, K_rot
        table = _table_rows(n_Q, n_K, offset) * spec.rope.rotary_dim(d_head)
        rotated = 2 * table + batch * (n_Q * q_width + n_new * kv_width)
    tuned = batch * n_Q * q_width if spec.temperature is not None else 0  # Q_tuned
    cached = 2 * batch * kv_width * (cache + n_K) if cache else 0  # K_cache, V_cache, K_cat, V_cat
    repeated = 2 * batch * n_K * q_width if n_kv_head != n_head else 0  # K_rep, V_rep
    matrices = (batch * n_head * n_Q * n_K * (2 + masked + softcap + alibi + bool(position_bias))
                + (n_head * n_Q * n_K if alibi else 0) + position_bias)
    outputs = 2 * batch * n_Q * q_width + batch * n_Q * d_feat  # x_raw, x_rsh1, x
    sinks = n_head if spec.sinks else 0  # the parameter [n_head]; sink_weight [.., n_Q] is a matrix's width
    matrices += batch * n_head * n_Q if spec.sinks else 0
    return (itemsize * (weights + inputs + feats + rotated + tuned + cached + repeated + outputs + sinks)
            + accumulated(itemsize) * matrices + _masks(n_Q, n_K, spec, user_mask, pad) + _scales(spec, n_Q))


def kv_cache_bytes(batch: int, n_kv_head: int, n_K: int, d_K: int, d_V: int, itemsize: int) -> int:
    """What this layer's KV cache holds for n_K positions: `n_batch · n_kv_head · n_K · (d_K + d_V) · bytes`,
    that is `2 · n_batch · n_kv_head · n_K · d_head · bytes` when d_K = d_V = d_head."""
    return batch * n_kv_head * n_K * (d_K + d_V) * itemsize


def mla_bytes(batch: int, n_Q: int, n_K: int, d_feat: int, n_head: int, spec: AttentionSpec, *,
              itemsize: int = 4, bias: bool = False, cross: bool = False, user_mask: bool = False,
              pad: bool = False) -> int:
    """Peak bytes of a traced `LatentAttention` (latent.py) of `spec` (whose `latent` gives the sizes) on random
    inputs: weights, inputs, the query's latent and projection, KV_feat, KV_latent, the rotary tables and parts,
    the latent cache and its concatenation, Q_full, KV_up, K_full, the per-head attention matrices, x_raw,
    x_rsh1 and x (the splits, Q_nope, K_nope, V_split and x_rsh2 are views; Q_pe and K_pe too unless
    rope_interleave gathers them). `n_K` counts every key, cached ones included."""
    L = spec.latent
    assert L is not None, "mla_bytes needs spec.latent"
    masked, offset, cache = user_mask or pad or spec.structural, spec.offset(n_Q, n_K), spec.cache
    softcap, alibi = spec.softcap is not None, spec.alibi
    d_nope, d_rope, d_V, d_latent, d_K = L.qk_nope_head_dim, L.qk_rope_head_dim, L.v_head_dim, L.kv_lora_rank, L.d_K
    n_new, q_width, kv_width = n_K - cache, n_head * d_K, n_head * (d_nope + d_V)
    if L.q_lora_rank is None:
        query_weights, query_steps = d_feat * q_width, 0
    else:
        rank = L.q_lora_rank
        query_weights = d_feat * rank + (rank if bias else 0) + rank + rank * q_width  # q_a (+bias), norm, q_b
        query_steps = 2 * batch * n_Q * rank  # Q_latent, Q_latent_normed
    weights = (query_weights + d_feat * (d_latent + d_rope) + ((d_latent + d_rope) if bias else 0) + d_latent
               + d_latent * kv_width + n_head * d_V * d_feat + (d_feat if bias else 0))
    inputs = batch * d_feat * (n_Q + n_new if cross else n_Q)
    gathered = batch * (n_head * n_Q + n_new) * d_rope if L.rope_interleave else 0  # Q_pe, K_pe as copies
    feats = batch * n_Q * q_width + batch * n_new * (2 * d_latent + d_rope)  # Q_feat, KV_feat, KV_latent
    rotated = 2 * _table_rows(n_Q, n_K, offset) * d_rope + batch * (n_head * n_Q + n_new) * d_rope  # cos, sin, *_pe_rot
    cached = batch * (cache + n_K) * (d_latent + d_rope) if cache else 0  # the latent cache and its cat
    joined = batch * n_head * (n_Q + n_K) * d_K + batch * n_K * kv_width  # Q_full, K_full, KV_up
    matrices = batch * n_head * n_Q * n_K * (2 + masked + softcap + alibi) + (n_head * n_Q * n_K if alibi else 0)
    outputs = 2 * batch * n_Q * n_head * d_V + batch * n_Q * d_feat  # x_raw, x_rsh1, x
    return (itemsize * (weights + inputs + query_steps + gathered + feats + rotated + cached + joined + outputs)
            + accumulated(itemsize) * matrices + _masks(n_Q, n_K, spec, user_mask, pad))
