"""The stages of a dot-product attention, in the order a layer runs them: project, split into heads, normalize
(qk-norm), rotate (RoPE), tune (Llama 4's temperature), join the cache, then `attend` (repeat KV, scores, softcap,
the mask applied, sinks, softmax, the weighted sum: scores ... out), and merge the heads and project back.

Each is a pure function of its tensors, the part of the spec it applies (a `Rope`, a `QkNorm`, a
`TemperatureTuning`, a `Mask` built before the attention: masks.py) and a `Recorder` (attnscope/trace.py: a Trace,
or `discard` when nothing is kept), through which it records its steps with the steps they read (`inputs`) and
their FLOPs as data (a `Cost`, counted when asked); it returns its tensors, recorded or not. A family's page
(models/families/llama.py's `attend`), `sdpa` (dot_product.py) and `MultiHeadAttention` (multihead.py) call them,
so a stage is written once.

Half precision: for float16/bfloat16 inputs the scores, the softmax and `attention @ V` are computed in float32
and the output is cast back, as PyTorch's math path does (`_scaled_dot_product_attention_math`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnscope.errors import UsageError
from attnscope.tensors import weight_threads

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor, nn

    from attnscope.masks import Mask
    from attnscope.spec import AttentionSpec
    from attnscope.trace import Recorder, Trace
    from attnscope.variants.qknorm import QkNorm
    from attnscope.variants.rope import Rope
    from attnscope.variants.temperature import TemperatureTuning

HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Names:
    """What the steps and axes of one attention are called.

    `sdpa` on its own uses the textbook names; `MultiHeadAttention` and the pages pass their own (`Q_rot`, `x_raw`,
    `d_head`, batch axes `n_batch, n_head`) so their trace reads as the tutorial does.
    """

    Q: str = "Q"
    K: str = "K"
    V: str = "V"
    out: str = "out"
    d_K: str = "d_K"
    d_V: str = "d_V"
    batch: tuple[str, ...] | None = None


def project(rec: Recorder, name: str, W: nn.Linear, x: Tensor, dims: tuple[str, ...],
            clip: tuple[float, float] | None = None) -> Tensor:
    """Step `{name}_feat` (`Q_feat`): `x` through the Linear `W` (`W_q(Q)`), `[n_batch, n, heads·d_head]`; clipped
    to `clip` (min, max) where given (DBRX's clip_qkv)."""
    feat = wide(W, x)  # [n_batch, n, d_in] -> [n_batch, n, heads·d_head]
    op = f"W_{name.lower()}({name})"
    if clip is not None:
        feat, op = feat.clamp(min=clip[0], max=clip[1]), f"{op}.clamp({clip[0]:g}, {clip[1]:g})"
    return rec(f"{name}_feat", feat, dims, op, ("linear", feat.shape, x.shape[-1], W.bias is not None), inputs=(name,))


def split(rec: Recorder, name: str, feat: Tensor, n_head: int, dims: tuple[str, ...], source: str,
          strided: bool = False) -> Tensor:
    """Step `{name}_split` (`Q_split`): the projection `source` split into `n_head` heads, a view; `dims` names
    `[n_batch, heads, n, d_head]`. `strided`: each head made of every n_head-th feature, `view(n_batch, -1, d_head,
    heads)` then moved (SuperGlue's checkpoint lays its heads so)."""
    if strided:
        n_batch, n, width = feat.shape
        return rec(f"{name}_split", feat.view(n_batch, n, width // n_head, n_head).permute(0, 3, 1, 2), dims,
                   f"{source}.view(n_batch, -1, d_head, {dims[1]}).permute(0, 3, 1, 2)", allocates=False,
                   inputs=(source,))
    return rec(f"{name}_split", split_heads(feat, n_head), dims,  # -> [n_batch, heads, n, d_head]
               f"{source}.view(n_batch, -1, {dims[1]}, d_head).permute(0, 2, 1, 3)", allocates=False,
               inputs=(source,))


def project_split(rec: Recorder, x: Tensor, W: tuple[nn.Linear, nn.Linear, nn.Linear], heads: tuple[int, int],
                  dims: tuple[tuple[str, ...], tuple[str, ...]],
                  widths: tuple[str, str]) -> tuple[Tensor, Tensor, Tensor]:
    """Steps `Q_feat, K_feat, V_feat` (x through W_q, W_k, W_v: `project`, their last axes named `widths`, the
    queries' and the keys') then `Q_split, K_split, V_split` (`split` into `heads`, n_head and n_kv_head,
    `[n_batch, heads, n, d_head]` named `dims`): how a layer's attention starts where nothing runs between the two."""
    three = ((dims[0], widths[0], heads[0]), (dims[1], widths[1], heads[1]), (dims[1], widths[1], heads[1]))
    feats = [project(rec, name, w, x, ("n_batch", d[2], wide))  # [n_batch, n, heads·d_head]
             for name, w, (d, wide, _) in zip("QKV", W, three, strict=True)]
    q, k, v = (split(rec, name, feat, n, d, f"{name}_feat")  # [n_batch, heads, n, d_head]
               for name, feat, (d, _, n) in zip("QKV", feats, three, strict=True))
    return q, k, v


def normalize(rec: Recorder, Q: Tensor, K: Tensor, norm: QkNorm, weights: tuple[Tensor | None, Tensor | None],
              *, source: tuple[str, str], dims: tuple[tuple[str, ...], tuple[str, ...]], axis: tuple[str, str],
              names: tuple[str | None, str | None] = (None, None),
              biases: tuple[Tensor | None, Tensor | None] = (None, None),
              clip: tuple[float, float] | None = None) -> tuple[Tensor, Tensor]:
    """Steps `Q_normed`, `K_normed`: the qk-norm of Q and K over their last axis (named `axis`, `qk_norm`: an
    RMSNorm, or a LayerNorm with `biases` too), with `weights` (None: unit weight) called `names` in the op
    (`q_norm.weight`; a bias `q_norm.bias`); clipped to `clip` (min, max) where given (HF OLMoE's clip_qkv, which
    clamps the norms' output)."""
    normed = []
    for step, x, weight, bias, src, shape, over, name in zip(("Q_normed", "K_normed"), (Q, K), weights, biases,
                                                             source, dims, axis, names, strict=True):
        y = qk_norm(x, weight, bias, norm)
        bias_name = None if bias is None else (name.replace("weight", "bias") if name else "b")
        op = norm_op(norm, src, over, name, bias_name)
        if clip is not None:
            y, op = y.clamp(min=clip[0], max=clip[1]), f"{op}.clamp({clip[0]:g}, {clip[1]:g})"
        normed.append(rec(step, y, shape, op, ("rms_norm", y.shape, weight is not None, 0), inputs=(src,)))
    return normed[0], normed[1]


def value_norm(rec: Recorder, V: Tensor, eps: float, *, source: str, dims: tuple[str, ...]) -> Tensor:
    """Step `V_normed`: each value head RMS-normed over its d_V without weights, `v · (mean(v², -1) + eps)^-½` in
    float32, cast back (Gemma 3n's `Gemma3nRMSNorm(head_dim, with_scale=False)`, Gemma 4's v_norm)."""
    v32 = V.float()
    y = (v32 * torch.pow(v32.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(V.dtype)  # [.., n, d_V]
    return rec("V_normed", y, dims, f"{source} * (mean({source}², dim=-1) + {eps:g})^-½ (the values' RMSNorm, no "
               "weights)", ("rms_norm", y.shape, False, 0), inputs=(source,))


def qk_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, norm: QkNorm) -> Tensor:
    """The qk-norm of x over its last axis, in float32, cast back to x's dtype (`Olmo2RMSNorm`, `Gemma3RMSNorm`):
    an RMSNorm, `x · rsqrt(mean(x², -1) + eps) · w` (or `· (1 + w)`, Gemma's offsets); or a LayerNorm (kind
    "layer", timm's Attention with qk_norm=True and norm_layer=nn.LayerNorm), `(x - mean) · rsqrt(var + eps) · w + b`
    (`F.layer_norm`). The norm's placement and kind are variants/qknorm.py's QkNorm."""
    if norm.kind == "layer":  # a bias is a LayerNorm's only
        w = None if weight is None else weight.float()
        b = None if bias is None else bias.float()
        if (w is None or w.dim() == 1) and (b is None or b.dim() == 1):
            return torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), w, b, norm.eps).to(x.dtype)  # [.., width]
        # a row per head (Cohere's [n_head, d_head] weights, held [n_head, 1, d_head]): the gain after the norm
        y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), None, None, norm.eps)  # [.., heads, n, width]
        return (y * (1.0 if w is None else w) + (0.0 if b is None else b)).to(x.dtype)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)  # [.., width]
    if weight is not None:
        normed = normed * (1.0 + weight.float() if norm.offset else weight.float())
    return normed.to(x.dtype)


def norm_op(norm: QkNorm, source: str, axis: str, weight: str | None, bias: str | None = None) -> str:
    """A qk-norm step's op: the formula, and over which axis (the head's or the projection's)."""
    scaled = "" if weight is None else (f" * (1 + {weight})" if norm.offset else f" * {weight}")
    if norm.kind == "layer":
        where = {"head": f"LayerNorm of each head over {axis}",
                 "proj": f"LayerNorm over the whole projection ({axis}), before the split"}[norm.over]
        shifted = "" if bias is None else f" + {bias}"
        centred = f"({source} - mean({source}, dim=-1))"
        return (f"{centred} * rsqrt(var({source}, dim=-1) + {norm.eps:g}){scaled}{shifted}: {where}"
                f"{', unit weight' if weight is None else ''}")
    where = {"head": f"RMSNorm of each head over {axis}",
             "proj": f"RMSNorm over the whole projection ({axis}), "
                     f"{'each position of the rotated heads at once' if norm.after_rope else 'before the split'}"
             }[norm.over]
    unit = ", unit weight" if weight is None else ""
    return f"{source} * rsqrt(mean({source}², dim=-1) + {norm.eps:g}){scaled}: {where}{unit}"


@dataclass(frozen=True)
class RopeTables:
    """RoPE's `cos` and `sin` `[n_pos - first, d_rot]` for positions `first .. n_pos - 1`, with their ops: made once
    before the attention, as transformers' model makes `position_embeddings = self.rotary_emb(x, position_ids)`
    before its layers and hands them to each attention (LlamaModel.forward). `positions`: the axis' name."""

    cos: Tensor
    sin: Tensor
    first: int
    d: int  # the head's size they were made for
    positions: str
    cos_op: str
    sin_op: str


def rope_tables(rope: Rope, *, q_offset: int, k_offset: int, n_Q: int, n_K: int, d: int, dtype: torch.dtype,
                device: Any, d_name: str, n_keys: int) -> RopeTables:
    """The tables `rotate` reads for n_Q queries from position `q_offset` and n_K keys from `k_offset` (a table
    from the first of them to the last: a score still depends on i − j alone); `n_keys` (n_K, every key) names
    the positions' axis when the table covers exactly them."""
    n_pos = max(k_offset + n_K, q_offset + n_Q)
    first = min(0, q_offset, k_offset)
    cos, sin = rope.cos_sin(n_pos, d, dtype, device, start=first)  # [n_pos - first, d_rot]
    return RopeTables(cos, sin, first, d, "n_K" if (first, n_pos) == (0, n_keys) else "n_pos",
                      rope.table_op("cos", d_name, d, n_pos, first), rope.table_op("sin", d_name, d, n_pos, first))


def call_tables(spec: AttentionSpec, X: Tensor, n_new: int, cache: tuple[Tensor, ...] | None, d: int, d_name: str,
                offset: int | None = None) -> RopeTables:
    """`rope_tables` for one attention call with `spec`'s RoPE, made before the attention (a module's forward, one
    head's inputs): the queries of X `[n_batch, n_Q, ..]` from position `offset` (by default where `spec` places
    them; after a `cache`, n_cache), the `n_new` new keys after the cache, a table of width `d` (named `d_name`)."""
    assert spec.rope is not None
    n_cache = 0 if cache is None else cache[0].shape[-2]
    if offset is None:  # a call with no cache: the spec places the queries
        offset = spec.offset(X.shape[1], n_new)
    return rope_tables(spec.rope, q_offset=n_cache if cache is not None else offset, k_offset=n_cache, n_Q=X.shape[1],
                       n_K=n_new, d=d, dtype=X.dtype, device=X.device, d_name=d_name, n_keys=n_cache + n_new)


def rotate(rec: Recorder, Q: Tensor, K: Tensor, rope: Rope, *, q_offset: int, k_offset: int, source: tuple[str, str],
           dims: tuple[tuple[str, ...], tuple[str, ...]], d_name: str, n_keys: int,
           tables: RopeTables | None = None) -> tuple[Tensor, Tensor]:
    """Steps `cos, sin, Q_rot, K_rot`: query i at `q_offset + i` (negative before key 0, lower-right with
    n_Q > n_K: a score still depends on i − j alone), key j at `k_offset + j`. `n_keys` (n_K, every key) names the
    positions' axis when the table covers exactly them. `tables`: made before the attention (`rope_tables`);
    None: made here."""
    tables = _recorded_tables(rec, Q, rope, q_offset=q_offset, k_offset=k_offset, n_K=K.shape[-2], d_name=d_name,
                              n_keys=n_keys, tables=tables)
    return (_turn(rec, "Q_rot", Q, rope, tables, q_offset, source[0], dims[0]),
            _turn(rec, "K_rot", K, rope, tables, k_offset, source[1], dims[1]))


def rotate_queries(rec: Recorder, Q: Tensor, rope: Rope, *, q_offset: int, source: str, dims: tuple[str, ...],
                   d_name: str, n_keys: int, tables: RopeTables | None = None) -> Tensor:
    """Steps `cos, sin, Q_rot` alone: the queries of a layer whose keys are another layer's, already rotated
    (Gemma 4's shared KV), query i at `q_offset + i` among the `n_keys` keys."""
    tables = _recorded_tables(rec, Q, rope, q_offset=q_offset, k_offset=0, n_K=0, d_name=d_name, n_keys=n_keys,
                              tables=tables)
    return _turn(rec, "Q_rot", Q, rope, tables, q_offset, source, dims)


def _recorded_tables(rec: Recorder, Q: Tensor, rope: Rope, *, q_offset: int, k_offset: int, n_K: int, d_name: str,
                     n_keys: int, tables: RopeTables | None) -> RopeTables:
    """Steps `cos, sin`: `tables` where they were made for Q's head size, dtype and device, else made here."""
    n_Q, d = Q.shape[-2], Q.shape[-1]
    if tables is None or (tables.d, tables.cos.dtype, tables.cos.device) != (d, Q.dtype, Q.device):
        tables = rope_tables(rope, q_offset=q_offset, k_offset=k_offset, n_Q=n_Q, n_K=n_K, d=d, dtype=Q.dtype,
                             device=Q.device, d_name=d_name, n_keys=n_keys)
    width = d_name if tables.cos.shape[-1] == d else "d_rot"
    rec("cos", tables.cos, (tables.positions, width), tables.cos_op)
    rec("sin", tables.sin, (tables.positions, width), tables.sin_op)
    return tables


def _turn(rec: Recorder, name: str, x: Tensor, rope: Rope, tables: RopeTables, offset: int, source: str,
          dims: tuple[str, ...]) -> Tensor:
    """Step `name` (`Q_rot`, `K_rot`): x `[.., n, d]` turned by its positions' rows of the tables, its first at
    position `offset`."""
    from attnscope.variants import rope as rotary

    cos, sin, n, d = tables.cos, tables.sin, x.shape[-2], x.shape[-1]
    start = offset - tables.first  # the table's row of this tensor's first position
    part = "" if (start, n) == (0, cos.shape[0]) else f"[{start}:{start + n}]"
    apply = rotary.apply_rope if rope.pairing == "half-split" else rotary.apply_rope_interleaved
    x_rot = apply(x, cos[start : start + n], sin[start : start + n])  # [.., n, d]
    return rec(name, x_rot, dims, rope.rotate_op(source, part, d), 3 * x_rot.numel() * cos.shape[-1] // max(d, 1),
               inputs=(source, "cos", "sin"))


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


def attend(rec: Trace, Q: Tensor, K: Tensor, V: Tensor, mask: Mask, names: Names, *, n_group: int = 1,
           sinks: Tensor | None = None, held: bool = False, dropout_p: float = 0.0,
           position_bias: Tensor | None = None, bias_stage: Callable[..., tuple[Tensor, str]] | None = None,
           batch_dims: tuple[str, ...] | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """Steps `[K_rep, V_rep], scores, [capped_scores], [alibi_bias | position_bias, biased_scores], [masked_scores],
    [sinks], attention, [sink_weight]` and the output (`names.out`, `x_raw` on a module's heads), on per-head Q
    `[.., n_Q, d_K]`, K `[.., n_K, d_K]`, V `[.., n_K, d_V]` (already steps of `rec`, called `names`), with n_group
    query heads to a K/V head (repeated here, transformers' `repeat_kv`). `mask` (masks.py's `Mask`, built before
    the attention) says what the scores may see and the rest of the spec this stage applies (scale, softcap, ALiBi,
    sinks); `sinks`: one logit per head (`held`: the module's parameter, counted with its weights);
    `position_bias` is added by `bias_stage` (position_bias.py's add_position_bias, which sdpa hands in); `dtype`: the
    inputs' (half precision is computed in float32). Returns the output `[.., n_Q, d_V]`."""
    spec, batch = mask.spec, names.batch if batch_dims is None else batch_dims
    assert batch is not None
    dtype = Q.dtype if dtype is None else dtype
    acc = torch.float32 if dtype in HALF else dtype
    if acc != dtype:
        rec.notes.append(half_note(dtype))
    n_Q, d_K, n_K = Q.shape[-2], Q.shape[-1], K.shape[-2]
    q_name, k_name, v_name = names.Q, names.K, names.V
    if n_group > 1:
        rec.notes.append(gqa_note(K.shape[-3], n_group))
        K, V = repeat_kv(rec, K, V, n_group, source=(k_name, v_name),
                         dims=((*leading_names(batch, K.dim()), "n_K", names.d_K),
                               (*leading_names(batch, V.dim()), "n_K", names.d_V)))
        k_name, v_name = "K_rep", "V_rep"

    scale_op = f"/ sqrt({names.d_K})" if spec.scale is None else f"* {spec.scale:g}"
    scale = 1.0 / math.sqrt(d_K) if spec.scale is None else spec.scale
    # V may carry more batch dims than Q and K (it broadcasts in `attention @ V`, as in PyTorch): the scores
    # have only Q's and K's.
    dims = (*leading_names(batch, max(Q.dim(), K.dim())), "n_Q", "n_K")
    up = ".float()" if acc != dtype else ""
    # mul_ on the fresh matmul result: no second [.., n_Q, n_K] tensor at the peak.
    scores = torch.matmul(Q.to(acc), K.to(acc).transpose(-2, -1)).mul_(scale)  # [.., n_Q, n_K]
    rec("scores", scores, dims, f"{q_name}{up} @ {k_name}{up}.transpose(-2, -1) {scale_op}",
        ("matmul", scores.shape, d_K, scores.numel()), inputs=(q_name, k_name))
    logits, last = scores, "scores"
    if spec.softcap is not None:
        logits = rec("capped_scores", scores.div(spec.softcap).tanh_().mul_(spec.softcap), dims,
                     f"{spec.softcap:g} * tanh(scores / {spec.softcap:g})", 3 * scores.numel(), inputs=("scores",))
        last = "capped_scores"
    if spec.alibi and position_bias is not None:
        raise UsageError("{alibi} and {position_bias} are two position biases; give one", "alibi", "position_bias")
    if spec.alibi:
        logits, last = _alibi(rec, logits, last, batch, mask.offset, spec.alibi_slopes)
    if position_bias is not None:
        assert bias_stage is not None  # sdpa's: position_bias.add_position_bias
        logits, last = bias_stage(rec, logits, last, position_bias, dims[:-2])
    if not mask.resolved:  # the caller's mask, checked against the scores as they are (sdpa's)
        from attnscope import masks

        mask = masks.fold(mask, tuple(logits.shape), logits.dtype, logits.device)
    if mask.additive is not None or mask.allowed is not None:
        op = last
        if mask.additive is not None:
            logits, op = logits + mask.additive, f"{last} + mask"
        if mask.allowed is not None:
            logits = logits.masked_fill(~mask.allowed, float("-inf"))
            op = f"({op})" if mask.additive is not None else op
            op = f"{op}.masked_fill(~{mask.hidden}, -inf)"
        rec("masked_scores", logits, dims, op, logits.numel(), inputs=(last,))
        last = "masked_scores"

    if spec.sinks:  # one more column per row, dropped after
        attention, sink_weight, attention_op = _sink_softmax(rec, logits, last, sinks, batch, held)
    else:
        attention, attention_op = torch.softmax(logits, dim=-1), f"softmax({last}, dim=-1)"  # [.., n_Q, n_K]
    if mask.blocked is not None:
        attention = zero_rows(attention, mask.blocked, rec, n_Q)
    if dropout_p > 0.0:
        attention = torch.nn.functional.dropout(attention, p=dropout_p, training=True)
        attention_op = f"dropout({attention_op}, p={dropout_p:g})"
    with_sink = (*attention.shape[:-1], attention.shape[-1] + spec.sinks)  # a sink is one more column to softmax
    rec("attention", attention, dims, attention_op, ("softmax", with_sink, 0, 0),
        inputs=(last, "sinks") if spec.sinks else (last,))
    if spec.sinks:
        rec("sink_weight", sink_weight, dims[:-1], "the softmax's last column, the weight the sink took: "
            "1 - attention.sum(-1)", sink_weight.numel())
        took = ""
        if sink_weight.device.type != "meta" and sink_weight.numel():
            low, high = float(torch.min(sink_weight.detach())), float(torch.max(sink_weight.detach()))
            took = f" (here the sink took {low:.3g} to {high:.3g} of a row)"
        rec.notes.append("attention sinks: each attention row sums to 1 - sink_weight, less than 1" + took
                         + "; the sink has no value, so out = attention @ V leaves that share out")

    out = torch.matmul(attention, V.to(acc))  # [.., n_Q, n_K] @ [.., n_K, d_V] -> [.., n_Q, d_V]
    out_op = f"attention @ {v_name}"
    if acc != dtype:
        out, out_op = out.to(dtype), f"(attention @ {v_name}.float()).to({dtype_name(dtype)})"
    return rec(names.out, out, (*batch, "n_Q", names.d_V), out_op, ("matmul", out.shape, n_K, 0),
               inputs=("attention", v_name))


def _alibi(rec: Trace, logits: Tensor, last: str, batch_dims: tuple[str, ...], offset: int,
           given: tuple[float, ...] | None = None) -> tuple[Tensor, str]:
    """Steps `alibi_bias` `[n_head, n_Q, n_K]` and `biased_scores`; the head axis is the one named n_head; `given`:
    the spec's own slopes (one head of a larger module)."""
    from attnscope.variants import alibi

    n_head = logits.shape[-3] if "n_head" in batch_dims and logits.dim() >= 3 else 1
    n_Q, n_K = logits.shape[-2], logits.shape[-1]
    m = alibi.slopes(n_head).tolist() if given is None else list(given)  # [n_head], once: the bias and its text
    bias = alibi.bias(n_head, n_Q, n_K, offset, logits.device, tuple(m)).to(logits.dtype)  # [n_head, n_Q, n_K]
    slopes = ", ".join(f"{s:.4g}" for s in m[:4]) + (", ..." if n_head > 4 else "")
    position = "i" if offset == 0 else f"(i + {offset})"
    rec("alibi_bias", bias, ("n_head", "n_Q", "n_K"), f"-slope[h] * ({position} - j), slopes {slopes}",
        3 * bias.numel())
    biased = logits + (bias if logits.dim() >= 3 else bias[0])  # [.., n_head, n_Q, n_K]; unbatched: [n_Q, n_K]
    rec("biased_scores", biased, rec.step(last).dims, f"{last} + alibi_bias", biased.numel(),
        inputs=(last, "alibi_bias"))
    return biased, "biased_scores"


def _sink_softmax(rec: Trace, logits: Tensor, last: str, sinks: Any, batch_dims: tuple[str, ...],
                  held: bool) -> tuple[Tensor, Tensor, str]:
    """Step `sinks` `[n_head]`, then the softmax over every row's keys and its sink (sinks.py says the formula): the
    attention (rows summing to 1 - sink_weight), the sink's weight `[.., n_Q]`, and the attention step's op."""
    if held:  # the module's parameter, one logit per head, checked when the module ran (multihead.py)
        values = rec("sinks", sinks.reshape(-1), ("n_head",),
                     "the module's parameter sinks, one logit per head (held with the weights)", allocates=False)
    else:
        from attnscope.attention import sinks as sinks_

        values = rec("sinks", sinks_.checked(sinks, sinks_.heads(logits, batch_dims)), ("n_head",),
                     "input: a learned logit per head, one more column of each softmax row")
    shaped = values.to(device=logits.device, dtype=logits.dtype)
    column = shaped.reshape(-1, 1, 1) if logits.dim() >= 3 else shaped.reshape(1, 1)  # [n_head, 1, 1] or [1, 1]
    if logits.shape[-1]:
        top = torch.maximum(logits.amax(dim=-1, keepdim=True), column)  # [.., n_Q, 1]: max over keys and sink
    else:
        top = column.expand(*logits.shape[:-1], 1)
    in_place = not (torch.is_grad_enabled() and logits.requires_grad)
    shifted = logits - top  # [.., n_Q, n_K]
    weights = shifted.exp_() if in_place else shifted.exp()
    sink = (column - top).exp()  # [.., n_Q, 1]
    total = weights.sum(dim=-1, keepdim=True) + sink  # [.., n_Q, 1]
    attention = weights.div_(total) if in_place else weights / total  # [.., n_Q, n_K]
    op = f"softmax(cat([{last}, sinks], dim=-1), dim=-1)[..., :-1]"
    return attention, (sink / total).squeeze(-1), op


def zero_rows(attention: Tensor, blocked: Tensor, trace: Trace, n_Q: int) -> Tensor:
    """A softmax of a row of -inf is NaN; PyTorch's attention gives 0 there (`_safe_softmax`), as attnscope."""
    if attention.device.type != "meta" and not bool(blocked.any()):
        return attention  # no row blocked: nothing to zero (a causal mask blocks none)
    if torch.is_grad_enabled() and attention.requires_grad:
        attention = attention.masked_fill(blocked, 0.0)  # softmax's backward needs its output unchanged
    else:
        attention.masked_fill_(blocked, 0.0)  # in place: no second [.., n_Q, n_K] at the peak
    if attention.device.type != "meta" and n_Q and 0 not in attention.shape[:-2] and bool(blocked.any()):
        rows = blocked if blocked.shape[-1] == 1 else blocked.transpose(-2, -1)  # [.., n_Q, 1]
        rows = rows.expand(*rows.shape[:-2], n_Q, 1)  # a mask shared by every query blocks all n_Q rows
        # [.., n_Q, 1] -> [n_rest, n_Q]: the rows any batch element blocks
        seen = sorted({int(i) for i in rows.reshape(-1, rows.shape[-2]).any(dim=0).nonzero().flatten()})
        shown = ", ".join(str(i) for i in seen[:12]) + (", ..." if len(seen) > 12 else "")
        trace.notes.append(f"{len(seen)} of {n_Q} query rows may attend to no key (n_Q index {shown}): their "
                           "attention and output are 0, as in F.scaled_dot_product_attention")
    return attention


def leading_names(names: tuple[str, ...], rank: int) -> tuple[str, ...]:
    """The batch names of a tensor with `rank - 2` leading axes (batch axes broadcast from the right)."""
    return names[len(names) - (rank - 2) :] if rank > 2 else ()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def half_note(dtype: torch.dtype) -> str:
    return (f"{dtype_name(dtype)} inputs: scores, softmax and attention @ V computed in float32, as PyTorch's math "
            f"path does (_scaled_dot_product_attention_math); out cast back to {dtype_name(dtype)}")


def axes(n_head: int, n_kv_head: int, d_head: int, d_feat: int, width: str = "d_feat") -> tuple[str, str, str]:
    """The key/value heads' axis (n_head where every query head has its own, else n_kv_head) and the names of the
    query and key/value projections' last axes: `width` (the input's width, d_feat, or a model's d_model) when one
    is d_feat wide, else `n_head·d_head`."""
    kv = "n_head" if n_kv_head == n_head else "n_kv_head"
    return (kv, *(width if n * d_head == d_feat else f"{name}·d_head"
                  for n, name in ((n_head, "n_head"), (n_kv_head, kv))))  # type: ignore[return-value]


def merge(rec: Recorder, x_raw: Tensor, W_o: nn.Linear, width: str, d_name: str = "d_head",
          strided: bool = False) -> Tensor:
    """Steps `x_rsh1, x_rsh2, x`: the heads' outputs `[n_batch, n_head, n_Q, d_head]` side by side again
    (`width`: the name of n_head·d_head; `d_name`: the values' per-head axis, d_V where it is not d_head) and through
    W_o. `strided`: merged as a strided split laid them, head the fastest (`[n_batch, n_Q, d_head, n_head]`)."""
    if strided:
        x_rsh1 = rec("x_rsh1", x_raw.permute(0, 2, 3, 1).contiguous(), ("n_batch", "n_Q", d_name, "n_head"),
                     "x_raw.permute(0, 2, 3, 1).contiguous()", inputs=("x_raw",))
    else:
        x_rsh1 = rec("x_rsh1", heads_last(x_raw), ("n_batch", "n_Q", "n_head", d_name),
                     "x_raw.permute(0, 2, 1, 3).contiguous()", inputs=("x_raw",))
    n_batch, n_Q, n_head, d_head = x_rsh1.shape
    x_rsh2 = rec("x_rsh2", x_rsh1.view(n_batch, n_Q, n_head * d_head),  # [n_batch, n_Q, n_head·d_head]
                 ("n_batch", "n_Q", width), f"x_rsh1.view(n_batch, -1, {width})", allocates=False,
                 inputs=("x_rsh1",))
    x = wide(W_o, x_rsh2)  # [n_batch, n_Q, d_feat]; a W_o as wide as the merge (trace's identity): [.., width]
    out = width if W_o.out_features == n_head * d_head else "d_feat"
    return rec("x", x, ("n_batch", "n_Q", out), "W_o(x_rsh2)",
               ("linear", x.shape, x_rsh2.shape[-1], W_o.bias is not None), inputs=("x_rsh2",))


def wide(product: Callable[..., Tensor], *args: Any) -> Tensor:
    """`product(*args)`, a product with weights (a Linear, `F.linear`), on the threads torch had where a short
    text's forward runs the rest on one (tensors/weight_threads.py's hook in force, `HOOKS[-1]`). A plain Linear's
    or F.linear's product big enough goes as parts of the weight's rows side by side, one torch thread each
    (tensors/rowsplit.py: each number a one-thread sum); any other runs whole on those threads, its sums split as
    they always did. Written here, not through `weight_threads.product_threads` (the value norms' context manager),
    so a page's attention on a tiny model enters no file of threads (issue 45's count)."""
    hooks = weight_threads.HOOKS
    if not hooks:
        return product(*args)
    linear = _as_linear(product, args)
    rowsplit = weight_threads.rowsplit
    # rowsplit.worth_parts' count of work (rows x the weight's numbers) asked here first: a tiny model's attention
    # enters no file of threads (issue 45's count); the rest of its checks there
    if linear is not None and linear[0].numel() * linear[1].shape[0] >= rowsplit.PARTS_FROM:
        parts = rowsplit.linear_in_parts(hooks[-1].threads, *linear)  # the weight's rows in parts, where worth it
        if parts is not None:
            return parts
    torch.set_num_threads(hooks[-1].threads)
    try:
        return product(*args)
    finally:
        torch.set_num_threads(1)


def _as_linear(product: Callable[..., Tensor], args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """`product(*args)` as F.linear's (input, weight, bias): a plain `nn.Linear` without hooks, or F.linear itself
    given its tensors by position; None for anything else."""
    if type(product) is torch.nn.Linear and len(args) == 1 and not (product._forward_hooks
                                                                   or product._forward_pre_hooks):
        return args[0], product.weight, product.bias
    if product is torch.nn.functional.linear and 2 <= len(args) <= 3:
        return args
    return None


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
