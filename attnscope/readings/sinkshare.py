"""Sink accounting: where a head parks its weight, and whether anything moves there.

For head h's pattern A `[n_Q, n_K]`, each a mean over the query rows that give weight somewhere (a row that
sees no key and has no sink is left out, as headstats.py leaves it out):

- first: `A[i, 0]`, the weight on the first token ([CLS], <s>, <bos>: the usual sink);
- sink: a learned sink's weight (GPT-OSS's `sink_weight`, the softmax's extra column that transformers' eager
  attention drops, `probs[..., :-1]`, so its exported rows sum to less than 1: attnscope keeps the column);
  absent where the attention has no sinks;
- top: `Σ_{j in top_keys} A[i, j]`, the weight on the TOP keys that gather the most weight over all queries
  (`top_keys`, largest column sums first, the earlier key first on a tie);
- weighted_first, weighted_top (with value_norms, moved.py): the same shares of the value-weighted pattern,
  each row first divided by its total `Σ_j a_ij ||f_h(x_j)||` (rows that move nothing left out), with its own
  `weighted_top_keys`. A learned sink has no value: its value-weighted share is 0, and is not listed.

Everything in float64; all heads of a layer at once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

TOP = 3  # the "few highest-weight keys"


def shares(A: Tensor, keep: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For row-normalised weights A `[n_head, n_Q, n_K]` float64 and the rows kept `[n_head, n_Q]`: each head's
    mean weight on key 0 `[n_head]`, on its top keys `[n_head]`, and those keys `[n_head, k]`."""
    import torch

    n_head, _, n_K = A.shape
    rows = keep.sum(dim=-1).clamp_min(1)  # [n_head]
    # [n_head, n_Q, n_K]; where every row is kept (a text's rows all see a key), A itself: no copy of its size
    kept = A if bool(keep.all()) else torch.where(keep[..., None], A, 0.0)
    if n_K == 0:
        empty = torch.zeros(n_head, dtype=torch.float64)
        return empty, empty, torch.zeros(n_head, 0, dtype=torch.long)
    first = kept[..., 0].sum(dim=-1) / rows
    columns = kept.sum(dim=1)  # [n_head, n_K]
    keys = columns.sort(dim=-1, descending=True, stable=True).indices[:, : min(TOP, n_K)]  # [n_head, k]
    top = columns.gather(-1, keys).sum(dim=-1) / rows
    return first, top, keys


def sink_shares(attention: Tensor, sink_weight: Tensor | None = None,
                norms: Tensor | None = None) -> list[dict[str, Any]]:
    """Each head's shares (module docstring) for patterns `[n_head, n_Q, n_K]`, the sinks' weights `[n_head, n_Q]`
    (None: no sinks) and value_norms `[n_head, n_K]` (None: no value-weighted shares)."""
    from attnscope.tensors.threads import one_thread

    with one_thread():
        return _sink_shares(attention, sink_weight, norms)


def _sink_shares(attention: Tensor, sink_weight: Tensor | None, norms: Tensor | None) -> list[dict[str, Any]]:
    import torch

    A = attention.detach().to(torch.float64)
    total = A.sum(dim=-1)  # [n_head, n_Q]
    sink = None if sink_weight is None else sink_weight.detach().to(torch.float64)
    keep = (total + (sink if sink is not None else 0.0)) > 0  # rows that give weight somewhere
    first, top, keys = shares(A, keep)
    columns: dict[str, Any] = {"first": first.tolist(), "top": top.tolist(), "top_keys": keys.tolist()}
    if sink is not None:
        columns["sink"] = (torch.where(keep, sink, 0.0).sum(dim=-1) / keep.sum(dim=-1).clamp_min(1)).tolist()
    if norms is not None:
        W = A * norms[:, None, :].to(torch.float64)  # [n_head, n_Q, n_K]: ||a_ij f_h(x_j)||
        moved = W.sum(dim=-1, keepdim=True)  # [n_head, n_Q, 1]
        share = W.div_(torch.where(moved > 0, moved, 1.0))  # in place: W is this function's own
        w_first, w_top, w_keys = shares(share, moved[..., 0] > 0)
        columns |= {"weighted_first": w_first.tolist(), "weighted_top": w_top.tolist(),
                    "weighted_top_keys": w_keys.tolist()}
    return [{key: values[h] for key, values in columns.items()} for h in range(A.shape[0])]


SHARE_KEYS = ("first", "sink", "top", "weighted_first", "weighted_top", "top_keys", "weighted_top_keys")


def grid(per_layer: list[list[dict[str, Any]]], layers: list[int]) -> dict[str, Any]:
    """The layer x head grid (JSON `sinks_share`, the page's sinks view) from each layer's `sink_shares`:
    `{"layers", "first", "top", "top_keys", ...}`, each a list a layer of a value a head; `sink` only where the
    attention has sinks, `weighted_*` where the values are known. A NaN share (a NaN pattern) is None."""
    out: dict[str, Any] = {"layers": list(layers)}
    for key in SHARE_KEYS:
        if per_layer and all(key in head for layer in per_layer for head in layer):
            out[key] = [[_finite(head[key]) for head in layer] for layer in per_layer]
    return out


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value
