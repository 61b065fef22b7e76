"""Scaled dot-product attention and multi-head attention, recorded step by step.

`sdpa()` is a pure function that returns a `Trace`; `MultiHeadAttention` calls it for its inner
step, so the two can never drift apart. Nothing here prints or imports a terminal library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from attnscope import cost, masks
from attnscope.errors import UsageError
from attnscope.trace import Trace

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class Names:
    """What the steps and axes of one attention are called.

    `sdpa` on its own uses the textbook names; `MultiHeadAttention` passes its own (`Q_split`,
    `x_raw`, `d_head`, batch axes `n_batch, n_head`) so its trace reads as the tutorial does.
    """

    Q: str = "Q"
    K: str = "K"
    V: str = "V"
    out: str = "out"
    d_K: str = "d_K"
    d_V: str = "d_V"
    batch: tuple[str, ...] | None = None


def batch_names(n: int) -> tuple[str, ...]:
    """Leading axes: `n_batch` for one, `n_batch_1, n_batch_2, ...` for several."""
    return ("n_batch",) if n == 1 else tuple(f"n_batch_{i + 1}" for i in range(n))


def _leading(names: tuple[str, ...], rank: int) -> tuple[str, ...]:
    """The batch names of a tensor with `rank - 2` leading axes (batch axes broadcast from the right)."""
    return names[len(names) - (rank - 2) :] if rank > 2 else ()


def common_dtype(*tensors: Tensor) -> tuple[torch.dtype, str | None]:
    """The dtype attention is computed in, and a note when inputs had to be converted."""
    if all(t.is_floating_point() for t in tensors):
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        mixed = len({t.dtype for t in tensors}) > 1
        return dtype, (f"inputs of different dtypes were computed in {dtype}" if mixed else None)
    found = sorted({str(t.dtype).removeprefix("torch.") for t in tensors if not t.is_floating_point()})
    return torch.float32, f"integer inputs ({', '.join(found)}) were computed in float32"


def check_qkv(Q: Tensor, K: Tensor, V: Tensor, layout: str = "row") -> tuple[int, ...]:
    """Validate shapes and return the broadcast batch shape. Row layout: `[.., n, d]`; column: `[.., d, n]`."""
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
    if K.shape[n_axis] != V.shape[n_axis]:
        raise UsageError(
            f"n_K = {K.shape[n_axis]} but n_V = {V.shape[n_axis]}: every key needs its value "
            f"(K {list(K.shape)}, V {list(V.shape)})"
        )
    try:
        return cost.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2])
    except ValueError:
        raise UsageError(
            f"the batch dims of Q {list(Q.shape[:-2])}, K {list(K.shape[:-2])} and V {list(V.shape[:-2])} "
            "do not broadcast; make them equal or 1"
        ) from None


def sdpa(
    Q: Tensor,
    K: Tensor,
    V: Tensor,
    mask: Tensor | None = None,
    scale: float | None = None,
    *,
    dropout_p: float = 0.0,
    names: Names | None = None,
) -> Trace:
    """Scaled dot-product attention: `out = softmax(Q Kᵀ · scale) V`, with `scale = 1/sqrt(d_K)` by default.

    Q `[.., n_Q, d_K]`, K `[.., n_K, d_K]`, V `[.., n_K, d_V]`, any leading batch dims that broadcast.
    `mask` is boolean (True = may attend) or float (added to the scores) and broadcasts to
    `[.., n_Q, n_K]`. Steps: `Q, K, V, scores, [masked_scores], attention, out`. A query that may
    attend to no key gets an output of zeros, as `F.scaled_dot_product_attention` gives.
    """
    names = names or Names()
    batch = check_qkv(Q, K, V)
    batch_dims = names.batch if names.batch is not None else batch_names(len(batch))
    dtype, dtype_note = common_dtype(Q, K, V)
    Q, K, V = Q.to(dtype), K.to(dtype), V.to(dtype)
    n_Q, d_K, n_K = Q.shape[-2], Q.shape[-1], K.shape[-2]

    trace = Trace()
    if dtype_note:
        trace.notes.append(dtype_note)
    trace.add(names.Q, Q, (*_leading(batch_dims, Q.dim()), "n_Q", names.d_K), "input")
    trace.add(names.K, K, (*_leading(batch_dims, K.dim()), "n_K", names.d_K), "input")
    trace.add(names.V, V, (*_leading(batch_dims, V.dim()), "n_K", names.d_V), "input")

    scale_op = f"/ sqrt({names.d_K})" if scale is None else f"* {scale:g}"
    scale = 1.0 / math.sqrt(d_K) if scale is None else scale
    scores_dims = (*batch_dims, "n_Q", "n_K")
    # mul_ on the fresh matmul result: no second [.., n_Q, n_K] tensor at the peak.
    scores = torch.matmul(Q, K.transpose(-2, -1)).mul_(scale)  # [.., n_Q, n_K]
    trace.add(
        "scores", scores, scores_dims, f"{names.Q} @ {names.K}.transpose(-2, -1) {scale_op}",
        cost.matmul_flops(scores.shape, d_K) + scores.numel(),
    )
    logits, mask = _masked_scores(trace, scores, mask, scores_dims, dtype)
    attention = torch.softmax(logits, dim=-1)  # [.., n_Q, n_K]
    attention_op = f"softmax({'masked_scores' if mask is not None else 'scores'}, dim=-1)"
    if mask is not None:
        blocked = masks.fully_masked_rows(mask)  # [.., n_Q, 1]
        attention = _zero_rows(attention, blocked, trace, n_Q)
    if dropout_p > 0.0:
        attention = F.dropout(attention, p=dropout_p, training=True)
        attention_op = f"dropout({attention_op}, p={dropout_p:g})"
    trace.add("attention", attention, scores_dims, attention_op, cost.softmax_flops(attention.shape))

    out = torch.matmul(attention, V)  # [.., n_Q, n_K] @ [.., n_K, d_V] -> [.., n_Q, d_V]
    trace.add(names.out, out, (*batch_dims, "n_Q", names.d_V), f"attention @ {names.V}",
              cost.matmul_flops(out.shape, n_K))
    return trace


def _masked_scores(trace: Trace, scores: Tensor, mask: Tensor | None, dims: tuple[str, ...],
                   dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """Apply the mask, recorded as its own step `masked_scores`; return the logits and the mask as used."""
    if mask is None:
        return scores, None
    mask = masks.as_attention_mask(mask.to(scores.device), tuple(scores.shape), dtype)
    if mask.dtype == torch.bool:
        logits, op = scores.masked_fill(~mask, float("-inf")), "scores.masked_fill(~mask, -inf)"
    else:
        logits, op = scores + mask, "scores + mask"
    trace.add("masked_scores", logits, dims, op, logits.numel())
    return logits, mask


def _zero_rows(attention: Tensor, blocked: Tensor, trace: Trace, n_Q: int) -> Tensor:
    """A softmax of a row of -inf is NaN; PyTorch's attention gives 0 there, and so does attnscope."""
    if torch.is_grad_enabled() and attention.requires_grad:
        attention = attention.masked_fill(blocked, 0.0)  # softmax's backward needs its output unchanged
    else:
        attention.masked_fill_(blocked, 0.0)  # in place: no second [.., n_Q, n_K] at the peak
    if attention.device.type != "meta" and bool(blocked.any()):
        rows = blocked if blocked.shape[-1] == 1 else blocked.transpose(-2, -1)
        trace.notes.append(_blocked_note(rows, n_Q))
    return attention


def _blocked_note(blocked: Tensor, n_Q: int) -> str:
    rows = sorted({int(i) for i in blocked.reshape(-1, blocked.shape[-2]).any(dim=0).nonzero().flatten()})
    shown = ", ".join(str(i) for i in rows[:12]) + (", ..." if len(rows) > 12 else "")
    return (
        f"{len(rows)} of {n_Q} query rows may attend to no key (n_Q index {shown}): "
        "their attention and output are 0, as in F.scaled_dot_product_attention"
    )


def sdpa_columns(Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None = None, scale: float | None = None) -> Trace:
    """The column convention: inputs stored `[.., d, n]`, `out = V · softmax(Kᵀ Q · scale)`, softmax over keys
    (dim -2). Q `[.., d_K, n_Q]`, K `[.., d_K, n_K]`, V `[.., d_V, n_K]` give out `[.., d_V, n_Q]`, which is the
    row form's out transposed. `mask` is in this form's scores layout, `[.., n_K, n_Q]`.
    """
    batch = check_qkv(Q, K, V, layout="col")
    batch_dims = batch_names(len(batch))
    dtype, dtype_note = common_dtype(Q, K, V)
    Q, K, V = Q.to(dtype), K.to(dtype), V.to(dtype)
    d_K, n_Q, n_K = Q.shape[-2], Q.shape[-1], K.shape[-1]

    trace = Trace()
    if dtype_note:
        trace.notes.append(dtype_note)
    trace.add("Q", Q, (*_leading(batch_dims, Q.dim()), "d_K", "n_Q"), "input")
    trace.add("K", K, (*_leading(batch_dims, K.dim()), "d_K", "n_K"), "input")
    trace.add("V", V, (*_leading(batch_dims, V.dim()), "d_V", "n_K"), "input")
    scale_op = "/ sqrt(d_K)" if scale is None else f"* {scale:g}"
    scale = 1.0 / math.sqrt(d_K) if scale is None else scale
    scores_dims = (*batch_dims, "n_K", "n_Q")
    scores = torch.matmul(K.transpose(-2, -1), Q).mul_(scale)  # [.., n_K, d_K] @ [.., d_K, n_Q] -> [.., n_K, n_Q]
    trace.add("scores", scores, scores_dims, f"K.transpose(-2, -1) @ Q {scale_op}",
              cost.matmul_flops(scores.shape, d_K) + scores.numel())
    logits, mask = _masked_scores(trace, scores, mask, scores_dims, dtype)
    attention = torch.softmax(logits, dim=-2)  # each column (one query) sums to 1 over the keys
    if mask is not None:
        blocked = masks.fully_masked_rows(mask.transpose(-2, -1)).transpose(-2, -1)  # [.., 1, n_Q]
        attention = _zero_rows(attention, blocked, trace, n_Q)
    trace.add("attention", attention, scores_dims,
              f"softmax({'masked_scores' if mask is not None else 'scores'}, dim=-2)",
              cost.softmax_flops(attention.shape))
    out = torch.matmul(V, attention)  # [.., d_V, n_K] @ [.., n_K, n_Q] -> [.., d_V, n_Q]
    trace.add("out", out, (*batch_dims, "d_V", "n_Q"), "V @ attention", cost.matmul_flops(out.shape, n_K))
    return trace


def project(X: Tensor, W_Q: Tensor, W_K: Tensor, W_V: Tensor) -> Trace:
    """The matrix form of the derivation: `Q = X W_Q`, `K = X W_K`, `V = X W_V`.

    X `[.., n, p]`, each W `[.., p, d]`. Steps: `X, W_Q, W_K, W_V, Q, K, V`.
    """
    for name, t in (("X", X), ("W_Q", W_Q), ("W_K", W_K), ("W_V", W_V)):
        if t.dim() < 2:
            raise UsageError(f"{name} has rank {t.dim()} (shape {list(t.shape)}); it needs rank 2 or more")
    for name, W in (("W_Q", W_Q), ("W_K", W_K), ("W_V", W_V)):
        if W.shape[-2] != X.shape[-1]:
            raise UsageError(
                f"X is {list(X.shape)} and {name} is {list(W.shape)}: X W needs {name}'s rows ({W.shape[-2]}) "
                f"to equal X's columns (p = {X.shape[-1]})"
            )
    if W_Q.shape[-1] != W_K.shape[-1]:
        raise UsageError(f"W_Q gives d_Q = {W_Q.shape[-1]} but W_K gives d_K = {W_K.shape[-1]}; they must be equal")
    dtype, dtype_note = common_dtype(X, W_Q, W_K, W_V)
    trace = Trace()
    if dtype_note:
        trace.notes.append(dtype_note)
    X = trace.add("X", X.to(dtype), (*batch_names(X.dim() - 2), "n", "p")[-X.dim():], "input")
    weights = {}
    for name, W, d in (("W_Q", W_Q, "d_K"), ("W_K", W_K, "d_K"), ("W_V", W_V, "d_V")):
        weights[name] = trace.add(name, W.to(dtype), (*batch_names(W.dim() - 2), "p", d)[-W.dim():], "input")
    for name, d in (("Q", "d_K"), ("K", "d_K"), ("V", "d_V")):
        try:
            P = torch.matmul(X, weights[f"W_{name}"])  # [.., n, p] @ [.., p, d] -> [.., n, d]
        except RuntimeError:
            raise UsageError(f"the batch dims of X {list(X.shape)} and W_{name} do not broadcast") from None
        n_dim = "n_Q" if name == "Q" else "n_K"
        trace.add(name, P, (*batch_names(P.dim() - 2), n_dim, d)[-P.dim():], f"X @ W_{name}",
                  cost.matmul_flops(P.shape, X.shape[-1]))
    return trace


def split_heads(x: Tensor, n_head: int) -> Tensor:
    """[n_batch, n, d_feat] -> [n_batch, n_head, n, d_head], a view (BERT's `transpose_for_scores`)."""
    n_batch, _, d_feat = x.shape
    return x.view(n_batch, -1, n_head, d_feat // n_head).permute(0, 2, 1, 3)  # [n_batch, n_head, n, d_head]


def heads_last(x: Tensor) -> Tensor:
    """[n_batch, n_head, n, d_head] -> [n_batch, n, n_head, d_head], copied so it can be viewed flat."""
    return x.permute(0, 2, 1, 3).contiguous()  # [n_batch, n, n_head, d_head]


def merge_heads(x: Tensor) -> Tensor:
    """[n_batch, n_head, n, d_head] -> [n_batch, n, d_feat], the inverse of `split_heads`."""
    return heads_last(x).flatten(-2)  # [n_batch, n, d_feat]


class MultiHeadAttention(nn.Module):
    """Multi-head attention as the tutorials write it: four Linear layers, split, SDPA per head, merge.

    `forward(Q, K=None, V=None, mask=None)` returns a `Trace` whose steps are `Q_feat, K_feat, V_feat,
    Q_split, K_split, V_split, scores, attention, x_raw, x_rsh1, x_rsh2, x`, so `out["x"]` is the
    output. Scores are scaled by `1/sqrt(d_head)`, as `torch.nn.MultiheadAttention` does.
    With `record=False` it skips the record and uses `F.scaled_dot_product_attention`; the trace
    then holds only `x`.
    """

    def __init__(
        self,
        d_feat: int,
        n_head: int,
        bias: bool = True,
        dropout_p: float = 0.0,
        record: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if d_feat <= 0 or n_head <= 0:
            raise UsageError(f"d_feat ({d_feat}) and n_head ({n_head}) must be positive")
        if d_feat % n_head:
            near = " or ".join(str(h) for h in cost.divisors_near(d_feat, n_head))
            raise UsageError(
                f"d_feat = {d_feat} is not divisible by n_head = {n_head}; head counts near it that divide "
                f"{d_feat}: {near}"
            )
        if not 0.0 <= dropout_p < 1.0:
            raise UsageError(f"dropout_p = {dropout_p} must be in [0, 1)")
        self.d_feat, self.n_head, self.d_head = d_feat, n_head, d_feat // n_head
        self.dropout_p, self.record = dropout_p, record
        factory = {"device": device, "dtype": dtype}
        self.W_q = nn.Linear(d_feat, d_feat, bias=bias, **factory)
        self.W_k = nn.Linear(d_feat, d_feat, bias=bias, **factory)
        self.W_v = nn.Linear(d_feat, d_feat, bias=bias, **factory)
        self.W_o = nn.Linear(d_feat, d_feat, bias=bias, **factory)

    def forward(self, Q: Tensor, K: Tensor | None = None, V: Tensor | None = None,
                mask: Tensor | None = None) -> Trace:
        K = Q if K is None else K
        V = K if V is None else V
        self._check_inputs(Q, K, V)
        if mask is not None and mask.dim() == 3:
            mask = mask.unsqueeze(1)  # [n_batch, n_Q, n_K] -> [n_batch, 1, n_Q, n_K]: the same for every head
        dropout_p = self.dropout_p if self.training else 0.0
        if not self.record:
            return self._forward_fused(Q, K, V, mask, dropout_p)

        n_batch, d_feat, n_head = Q.shape[0], self.d_feat, self.n_head
        bias = self.W_q.bias is not None
        trace = Trace()
        for name, inp, W, n in (("Q", Q, self.W_q, "n_Q"), ("K", K, self.W_k, "n_K"), ("V", V, self.W_v, "n_K")):
            feat = W(inp)  # [n_batch, n, d_feat]
            trace.add(f"{name}_feat", feat, ("n_batch", n, "d_feat"), f"W_{name.lower()}({name})",
                      cost.linear_flops(feat.shape, d_feat, bias))
        for name, n in (("Q", "n_Q"), ("K", "n_K"), ("V", "n_K")):
            trace.add(f"{name}_split", split_heads(trace[f"{name}_feat"], n_head),  # -> [n_batch, n_head, n, d_head]
                      ("n_batch", "n_head", n, "d_head"),
                      f"{name}_feat.view(n_batch, -1, n_head, d_head).permute(0, 2, 1, 3)", allocates=False)

        inner = sdpa(trace["Q_split"], trace["K_split"], trace["V_split"], mask, dropout_p=dropout_p,
                     names=MHA_NAMES)
        for step in inner.steps[3:]:  # scores, [masked_scores], attention, x_raw: Q/K/V_split are already here
            trace.add_step(step)
        trace.notes.extend(inner.notes)

        x_rsh1 = trace.add("x_rsh1", heads_last(trace["x_raw"]), ("n_batch", "n_Q", "n_head", "d_head"),
                           "x_raw.permute(0, 2, 1, 3).contiguous()")
        x_rsh2 = trace.add("x_rsh2", x_rsh1.view(n_batch, -1, d_feat), ("n_batch", "n_Q", "d_feat"),
                           "x_rsh1.view(n_batch, -1, d_feat)", allocates=False)
        x = self.W_o(x_rsh2)  # [n_batch, n_Q, d_feat]
        trace.add("x", x, ("n_batch", "n_Q", "d_feat"), "W_o(x_rsh2)", cost.linear_flops(x.shape, d_feat, bias))
        return trace

    def _forward_fused(self, Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None, dropout_p: float) -> Trace:
        q = split_heads(self.W_q(Q), self.n_head)  # [n_batch, n_head, n_Q, d_head]
        k = split_heads(self.W_k(K), self.n_head)  # [n_batch, n_head, n_K, d_head]
        v = split_heads(self.W_v(V), self.n_head)  # [n_batch, n_head, n_K, d_head]
        if mask is not None:
            scores_shape = (Q.shape[0], self.n_head, Q.shape[1], K.shape[1])
            mask = masks.as_attention_mask(mask.to(q.device), scores_shape, q.dtype)
        x_raw = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        x = self.W_o(merge_heads(x_raw))  # [n_batch, n_Q, d_feat]
        trace = Trace()
        trace.add("x", x, ("n_batch", "n_Q", "d_feat"), "W_o(merge_heads(F.scaled_dot_product_attention(...)))")
        return trace

    def _check_inputs(self, Q: Tensor, K: Tensor, V: Tensor) -> None:
        for name, t in (("Q", Q), ("K", K), ("V", V)):
            if t.dim() != 3 or t.shape[-1] != self.d_feat:
                raise UsageError(
                    f"{name} is {list(t.shape)} but multi-head attention takes [n_batch, n, d_feat] "
                    f"with d_feat = {self.d_feat}"
                )
        if not Q.shape[0] == K.shape[0] == V.shape[0]:
            raise UsageError(f"n_batch differs: Q {Q.shape[0]}, K {K.shape[0]}, V {V.shape[0]}")
        if K.shape[1] != V.shape[1]:
            raise UsageError(f"n_K = {K.shape[1]} but n_V = {V.shape[1]}: every key needs its value")


MHA_NAMES = Names(Q="Q_split", K="K_split", V="V_split", out="x_raw", d_K="d_head", d_V="d_head",
                  batch=("n_batch", "n_head"))
