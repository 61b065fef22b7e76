"""The stages every dot-product attention shares, in the order a layer runs them: project, split into heads,
normalize (qk-norm), rotate (RoPE), tune (Llama 4's temperature), join the cache, repeat KV, and after `sdpa`'s
scores ... out, merge the heads and project back.

Each is a pure function of its tensors, the part of the spec it applies (a `Rope`, a `QkNorm`, a
`TemperatureTuning`) and a `Recorder` (attnscope/trace.py: a Trace's `add`, or `discard` when nothing is kept),
through which it records its steps with the steps they read (`inputs`); it returns its tensors, recorded or not.
`sdpa` (dot_product.py), `MultiHeadAttention` (multihead.py) and the pages that write their attention out
(models/families/) call them, so a stage is written once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnscope import cost
from attnscope.errors import UsageError
from attnscope.variants import qknorm

if TYPE_CHECKING:
    from torch import Tensor, nn

    from attnscope.trace import Recorder
    from attnscope.variants.qknorm import QkNorm
    from attnscope.variants.rope import Rope
    from attnscope.variants.temperature import TemperatureTuning


def project(rec: Recorder, name: str, W: nn.Linear, x: Tensor, dims: tuple[str, ...]) -> Tensor:
    """Step `{name}_feat` (`Q_feat`): `x` through the Linear `W` (`W_q(Q)`), `[n_batch, n, heads·d_head]`."""
    feat = W(x)  # [n_batch, n, d_in] -> [n_batch, n, heads·d_head]
    return rec(f"{name}_feat", feat, dims, f"W_{name.lower()}({name})",
               cost.linear_flops(feat.shape, x.shape[-1], W.bias is not None), inputs=(name,))


def split(rec: Recorder, name: str, feat: Tensor, n_head: int, dims: tuple[str, ...], source: str) -> Tensor:
    """Step `{name}_split` (`Q_split`): the projection `source` split into `n_head` heads, a view; `dims` names
    `[n_batch, heads, n, d_head]`."""
    return rec(f"{name}_split", split_heads(feat, n_head), dims,  # -> [n_batch, heads, n, d_head]
               f"{source}.view(n_batch, -1, {dims[1]}, d_head).permute(0, 2, 1, 3)", allocates=False,
               inputs=(source,))


def normalize(rec: Recorder, Q: Tensor, K: Tensor, norm: QkNorm, weights: tuple[Tensor | None, Tensor | None],
              *, source: tuple[str, str], dims: tuple[tuple[str, ...], tuple[str, ...]], axis: tuple[str, str],
              names: tuple[str | None, str | None] = (None, None),
              biases: tuple[Tensor | None, Tensor | None] = (None, None)) -> tuple[Tensor, Tensor]:
    """Steps `Q_normed`, `K_normed`: the RMSNorm of Q and K over their last axis (named `axis`, qknorm.rms_norm), or
    their LayerNorm with `biases` too (qknorm.layer_norm), with `weights` (None: unit weight) called `names` in the
    op (`q_norm.weight`; a bias `q_norm.bias`)."""
    normed = []
    for step, x, weight, bias, src, shape, over, name in zip(("Q_normed", "K_normed"), (Q, K), weights, biases,
                                                             source, dims, axis, names, strict=True):
        y = qknorm.apply(x, weight, bias, norm)
        bias_name = None if bias is None else (name.replace("weight", "bias") if name else "b")
        normed.append(rec(step, y, shape, norm.op(src, over, name, bias_name),
                          cost.rms_norm_flops(y.shape, weight is not None), inputs=(src,)))
    return normed[0], normed[1]


def rotate(rec: Recorder, Q: Tensor, K: Tensor, rope: Rope, *, q_offset: int, k_offset: int, source: tuple[str, str],
           dims: tuple[tuple[str, ...], tuple[str, ...]], d_name: str, n_keys: int) -> tuple[Tensor, Tensor]:
    """Steps `cos, sin, Q_rot, K_rot`: query i at `q_offset + i` (negative before key 0, lower-right with
    n_Q > n_K: a score still depends on i − j alone), key j at `k_offset + j`. `n_keys` (n_K, every key) names the
    positions' axis when the table covers exactly them."""
    from attnscope.variants import rope as rotary

    n_Q, n_K, d = Q.shape[-2], K.shape[-2], Q.shape[-1]
    n_pos = max(k_offset + n_K, q_offset + n_Q)
    first = min(0, q_offset, k_offset)
    cos, sin = rope.cos_sin(n_pos, d, Q.dtype, Q.device, start=first)  # [n_pos - first, d_rot]
    pos = "n_K" if (first, n_pos) == (0, n_keys) else "n_pos"
    width = d_name if cos.shape[-1] == d else "d_rot"
    rec("cos", cos, (pos, width), rope.table_op("cos", d_name, d, n_pos, first))
    rec("sin", sin, (pos, width), rope.table_op("sin", d_name, d, n_pos, first))
    apply = rotary.apply_rope if rope.pairing == "half-split" else rotary.apply_rope_interleaved
    rotated = []
    for name, x, offset, n, shape in (("Q_rot", Q, q_offset, n_Q, dims[0]), ("K_rot", K, k_offset, n_K, dims[1])):
        start = offset - first  # the table's row of this tensor's first position
        part = "" if (start, n) == (0, cos.shape[0]) else f"[{start}:{start + n}]"
        src = source[0] if name == "Q_rot" else source[1]
        x_rot = apply(x, cos[start : start + n], sin[start : start + n])  # [.., n, d]
        rotated.append(rec(name, x_rot, shape, rope.rotate_op(src, part, d),
                           3 * x_rot.numel() * cos.shape[-1] // max(d, 1), inputs=(src, "cos", "sin")))
    return rotated[0], rotated[1]


def tune(rec: Recorder, Q: Tensor, temperature: TemperatureTuning, *, start: int, source: str,
         dims: tuple[str, ...]) -> Tensor:
    """Steps `attn_scales` `[n_Q]` and `Q_tuned`: each query scaled by its position's factor, query i at position
    `start + i` (transformers' `Llama4TextAttention`: `(query_states * attn_scales).to(query_states.dtype)`, the
    factor computed in float32)."""
    n_Q = Q.shape[-2]
    if start < 0:
        raise UsageError(f"{{temperature}}: aligned lower-right with fewer keys than queries, query 0 sits at position "
                         f"{start}, and the temperature's factor is only defined from position 0; give at least as "
                         "many keys as queries, or align upper-left", "temperature")
    scales = rec("attn_scales", temperature.scales(start, n_Q, Q.device), ("n_Q",), temperature.op(start), 6 * n_Q)
    tuned = (Q * scales[:, None]).to(Q.dtype)  # [.., n_Q, d] * [n_Q, 1]
    dtype = str(Q.dtype).removeprefix("torch.")
    return rec("Q_tuned", tuned, dims, f"({source} * attn_scales[:, None]).to({dtype})", tuned.numel(),
               inputs=(source, "attn_scales"))


def join_cache(rec: Recorder, k: Tensor, v: Tensor, cache: tuple[Tensor, Tensor], axis: str,
               made: tuple[str, str]) -> tuple[Tensor, Tensor]:
    """Steps `K_cache, V_cache, K_cat, V_cat`: the cached keys and values (`[n_batch, axis, n_cache, d_head]`,
    the keys already rotated) before the new ones (named `made`)."""
    cached, full = ("n_batch", axis, "n_cache", "d_head"), ("n_batch", axis, "n_K", "d_head")
    K_cache = rec("K_cache", cache[0].to(k.dtype), cached, "input: cached keys (already rotated)")
    V_cache = rec("V_cache", cache[1].to(v.dtype), cached, "input: cached values")
    return (rec("K_cat", torch.cat([K_cache, k], dim=-2), full, f"torch.cat([K_cache, {made[0]}], dim=-2)",
                inputs=("K_cache", made[0])),  # [n_batch, axis, n_cache + n_new, d_head]
            rec("V_cat", torch.cat([V_cache, v], dim=-2), full, f"torch.cat([V_cache, {made[1]}], dim=-2)",
                inputs=("V_cache", made[1])))


def repeat_kv(rec: Recorder, K: Tensor, V: Tensor, n_group: int, *, source: tuple[str, str],
              dims: tuple[tuple[str, ...], tuple[str, ...]]) -> tuple[Tensor, Tensor]:
    """Steps `K_rep, V_rep`: each K/V head repeated for the n_group query heads it serves (transformers'
    `repeat_kv`, which is `repeat_interleave(n_group, dim=1)`); `dims` name the repeated tensors' axes."""
    K_rep = K.repeat_interleave(n_group, dim=-3)  # [.., n_kv_head, n_K, d] -> [.., n_head, n_K, d]
    V_rep = V.repeat_interleave(n_group, dim=-3)
    for name, src, tensor, shape in (("K_rep", source[0], K_rep, dims[0]), ("V_rep", source[1], V_rep, dims[1])):
        rec(name, tensor, shape, f"repeat_kv({src}, n_group={n_group}) = {src}.repeat_interleave({n_group}, dim=-3)",
            inputs=(src,))
    return K_rep, V_rep


def gqa_note(n_kv_head: int, n_group: int) -> str:
    """Which query heads each K/V head serves, in words (the first four)."""
    shown = [f"KV head {g}: query heads {g * n_group}-{(g + 1) * n_group - 1}" for g in range(min(n_kv_head, 4))]
    more = f", ... ({n_kv_head} KV heads)" if n_kv_head > 4 else ""
    return f"grouped-query attention, n_group = {n_group}: " + "; ".join(shown) + more


def merge(rec: Recorder, x_raw: Tensor, W_o: nn.Linear, width: str) -> Tensor:
    """Steps `x_rsh1, x_rsh2, x`: the heads' outputs `[n_batch, n_head, n_Q, d_head]` side by side again
    (`width`: the name of n_head·d_head) and through W_o."""
    x_rsh1 = rec("x_rsh1", heads_last(x_raw), ("n_batch", "n_Q", "n_head", "d_head"),
                 "x_raw.permute(0, 2, 1, 3).contiguous()", inputs=("x_raw",))
    n_batch, n_Q, n_head, d_head = x_rsh1.shape
    x_rsh2 = rec("x_rsh2", x_rsh1.view(n_batch, n_Q, n_head * d_head),  # [n_batch, n_Q, n_head·d_head]
                 ("n_batch", "n_Q", width), f"x_rsh1.view(n_batch, -1, {width})", allocates=False,
                 inputs=("x_rsh1",))
    x = W_o(x_rsh2)  # [n_batch, n_Q, d_feat]
    return rec("x", x, ("n_batch", "n_Q", "d_feat"), "W_o(x_rsh2)",
               cost.linear_flops(x.shape, x_rsh2.shape[-1], W_o.bias is not None), inputs=("x_rsh2",))


def split_heads(x: Tensor, n_head: int) -> Tensor:
    """[n_batch, n, n_head·d_head] -> [n_batch, n_head, n, d_head], a view (BERT's `transpose_for_scores`)."""
    n_batch, n, width = x.shape  # n, not -1: an empty batch leaves -1 undefined
    return x.view(n_batch, n, n_head, width // n_head).permute(0, 2, 1, 3)  # [n_batch, n_head, n, d_head]


def heads_last(x: Tensor) -> Tensor:
    """[n_batch, n_head, n, d_head] -> [n_batch, n, n_head, d_head], copied so it can be viewed flat."""
    return x.permute(0, 2, 1, 3).contiguous()  # [n_batch, n, n_head, d_head]


def merge_heads(x: Tensor) -> Tensor:
    """[n_batch, n_head, n, d_head] -> [n_batch, n, n_head·d_head], the inverse of `split_heads`."""
    return heads_last(x).flatten(-2)  # [n_batch, n, n_head·d_head]
