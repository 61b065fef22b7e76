"""The other forms of the derivation: the column convention (inputs stored `[.., d, n]`) and the matrix
form (`Q = X W_Q`, `K = X W_K`, `V = X W_V`, or `Q = W_Q X` ... with one token a column), each recorded step
by step."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from attnscope import cost, masks
from attnscope.attention.dot_product import Names, batch_names, common_dtype, dtype_name, leading_names, prologue
from attnscope.attention.stages import zero_rows
from attnscope.errors import UsageError
from attnscope.spec import AttentionSpec
from attnscope.trace import Trace

if TYPE_CHECKING:
    from torch import Tensor


def sdpa_columns(Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None = None, scale: float | None = None) -> Trace:
    """The column convention: inputs stored `[.., d, n]`, `out = V · softmax(Kᵀ Q · scale)`, softmax over keys
    (dim -2). Q `[.., d_K, n_Q]`, K `[.., d_K, n_K]`, V `[.., d_V, n_K]` give out `[.., d_V, n_Q]`, which is the
    row form's out transposed. `mask` is in this form's scores layout, `[.., n_K, n_Q]`, under the same dtype
    rule as `sdpa`'s; half precision is computed in float32 as there.
    """
    AttentionSpec(scale=scale)  # checks the scale
    inputs = prologue(Q, K, V, Names(), layout="col")
    trace, Q, K, V, batch_dims, dtype, acc = (inputs.trace, inputs.Q, inputs.K, inputs.V, inputs.batch_dims,
                                              inputs.dtype, inputs.acc)
    d_K, n_Q, n_K = Q.shape[-2], Q.shape[-1], K.shape[-1]

    scale_op = "/ sqrt(d_K)" if scale is None else f"* {scale:g}"
    scale = 1.0 / math.sqrt(d_K) if scale is None else scale
    scores_dims = (*leading_names(batch_dims, max(Q.dim(), K.dim())), "n_K", "n_Q")  # V may have more batch dims
    up = ".float()" if acc != dtype else ""
    scores = torch.matmul(K.to(acc).transpose(-2, -1), Q.to(acc)).mul_(scale)  # [.., n_K, d_K] @ [.., d_K, n_Q]
    trace.add("scores", scores, scores_dims, f"K{up}.transpose(-2, -1) @ Q{up} {scale_op}",
              cost.matmul_flops(scores.shape, d_K) + scores.numel())
    logits, last = scores, "scores"
    blocked = None
    if mask is not None:
        mask = masks.as_attention_mask(mask.to(scores.device), tuple(scores.shape), acc)
        mask = mask.reshape(1, -1) if mask.dim() < 2 else mask  # [n_Q]: the same for every key
        if mask.dtype == torch.bool:
            logits, op = scores.masked_fill(~mask, float("-inf")), "scores.masked_fill(~mask, -inf)"
        else:
            logits, op = scores + mask, "scores + mask"
        trace.add("masked_scores", logits, scores_dims, op, logits.numel())
        last = "masked_scores"
        blocked = masks.fully_masked_rows(mask.transpose(-2, -1)).transpose(-2, -1)  # [.., 1, n_Q]
    attention = torch.softmax(logits, dim=-2)  # each column (one query) sums to 1 over the keys
    if blocked is not None:
        attention = zero_rows(attention, blocked, trace, n_Q)
    trace.add("attention", attention, scores_dims, f"softmax({last}, dim=-2)", cost.softmax_flops(attention.shape))
    out = torch.matmul(V.to(acc), attention)  # [.., d_V, n_K] @ [.., n_K, n_Q] -> [.., d_V, n_Q]
    out_op = "V @ attention"
    if acc != dtype:
        out, out_op = out.to(dtype), f"(V.float() @ attention).to({dtype_name(dtype)})"
    trace.add("out", out, (*batch_dims, "d_V", "n_Q"), out_op, cost.matmul_flops(out.shape, n_K))
    return trace


def project(X: Tensor, W_Q: Tensor, W_K: Tensor, W_V: Tensor, layout: str = "row") -> Trace:
    """The matrix form of the derivation: `Q = X W_Q`, `K = X W_K`, `V = X W_V` (row layout: one token a row,
    X `[.., n, p]`, each W `[.., p, d]`), or in the column layout of a derivation on paper, `Q = W_Q X`, `K = W_K X`,
    `V = W_V X` (one token a column: X `[.., p, n]`, each W `[.., d, p]`, Q `[.., d_K, n]`, what `sdpa_columns`
    takes). Steps: `X, W_Q, W_K, W_V, Q, K, V`.
    """
    col = layout == "col"
    for name, t in (("X", X), ("W_Q", W_Q), ("W_K", W_K), ("W_V", W_V)):
        if t.dim() < 2:
            raise UsageError(f"{name} has rank {t.dim()} (shape {list(t.shape)}); it needs rank 2 or more")
    p_X = X.shape[-2] if col else X.shape[-1]
    for name, W in (("W_Q", W_Q), ("W_K", W_K), ("W_V", W_V)):
        p_W = W.shape[-1] if col else W.shape[-2]
        if p_W != p_X:
            where, product = ("columns", "W X") if col else ("rows", "X W")
            raise UsageError(f"X is {list(X.shape)} and {name} is {list(W.shape)}: {product} needs {name}'s {where} "
                             f"({p_W}) to equal X's {'rows' if col else 'columns'} (p = {p_X})")
    d_Q, d_K = (W_Q.shape[-2], W_K.shape[-2]) if col else (W_Q.shape[-1], W_K.shape[-1])
    if d_Q != d_K:
        raise UsageError(f"W_Q gives d_Q = {d_Q} but W_K gives d_K = {d_K}; they must be equal")
    dtype, dtype_note = common_dtype(X, W_Q, W_K, W_V)
    trace = Trace()
    if dtype_note:
        trace.notes.append(dtype_note)
    X = trace.add("X", X.to(dtype), (*batch_names(X.dim() - 2), *(("p", "n") if col else ("n", "p")))[-X.dim():],
                  "input")
    weights = {}
    for name, W, d in (("W_Q", W_Q, "d_K"), ("W_K", W_K, "d_K"), ("W_V", W_V, "d_V")):
        dims = (*batch_names(W.dim() - 2), *((d, "p") if col else ("p", d)))[-W.dim():]
        weights[name] = trace.add(name, W.to(dtype), dims, "input")
    for name, d in (("Q", "d_K"), ("K", "d_K"), ("V", "d_V")):
        W = weights[f"W_{name}"]
        try:
            # row: [.., n, p] @ [.., p, d] -> [.., n, d]; col: [.., d, p] @ [.., p, n] -> [.., d, n]
            P = torch.matmul(W, X) if col else torch.matmul(X, W)
        except RuntimeError:
            raise UsageError(f"the batch dims of X {list(X.shape)} and W_{name} do not broadcast") from None
        n_dim = "n_Q" if name == "Q" else "n_K"
        dims = (*batch_names(P.dim() - 2), *((d, n_dim) if col else (n_dim, d)))[-P.dim():]
        trace.add(name, P, dims, f"W_{name} @ X" if col else f"X @ W_{name}", cost.matmul_flops(P.shape, p_X))
    return trace
