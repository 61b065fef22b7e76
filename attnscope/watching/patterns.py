"""A watched layer's patterns, made after the forward from what was kept (watching/record.py), in blocks of query
rows: float32 on the model's device, each block moved to the CPU as it is done, so what the device holds at once
is one block `[n_head, rows, n_K]`, never the layer's (or the model's) every pattern.

The formula is the one transformers' eager attention computes (llama's `eager_attention_forward`; Gemma 2's
softcap, GPT-OSS's sinks; `sdpa_attention_forward`'s `is_causal` and `create_position_bias_mask`; flash's causal
and window from the module): scores = Q K^T * scaling, softcap * tanh(scores / softcap), + position_bias, the
mask (a boolean one as the dtype's minimum, as eager's additive masks fill), softmax with a sink column joined
and dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from attnscope.watching.record import Call, Layer

BLOCK_CELLS = 1 << 22  # scores a block holds, every head asked together (16 MiB in float32)


def layer_pattern(layer: Layer, heads: list[int], batch: int, dtype: Any = None) -> torch.Tensor:
    """`[len(heads), n_rows, n_keys]` on the CPU, float32 (`dtype` float64 for the reference): the heads' rows of
    every call, each call's keys at its columns, zeros where a key was not handed (a window's evicted keys)."""
    import torch

    dtype = dtype or torch.float32
    out = torch.zeros(len(heads), layer.n_rows, layer.n_keys, dtype=dtype)
    index = torch.tensor(heads)
    group = layer.n_head // layer.n_kv_head
    for call in layer.calls:
        if call.weights is not None:  # transformers' own attentions
            block = call.weights[batch, index].to(dtype)  # [n_heads, n_Q, n_K]
            out[:, call.row0:call.row0 + call.n_Q, call.key0:call.key0 + call.n_K] = block
            continue
        assert call.Q is not None
        K = layer.key_range(call)[batch, index // group].to(dtype)  # [n_heads, n_K, d_head]
        rows = max(1, BLOCK_CELLS // max(1, call.n_K * len(heads)))
        for start in range(0, call.n_Q, rows):
            stop = min(call.n_Q, start + rows)
            Q = call.Q[batch, index, start:stop].to(dtype)  # [n_heads, rows, d_head]
            block = weights(call, Q, K, index, batch, start, stop)  # [n_heads, rows, n_K]
            out[:, call.row0 + start:call.row0 + stop, call.key0:call.key0 + call.n_K] = block.cpu()
    return out


def weights(call: Call, Q: torch.Tensor, K: torch.Tensor, heads: torch.Tensor, batch: int, start: int,
            stop: int) -> torch.Tensor:
    """Rows `start:stop` of the call's attention for `heads`: `[n_heads, rows, n_K]`, in Q's dtype."""
    import torch

    scores = torch.matmul(Q, K.transpose(-1, -2)) * call.scale  # [n_heads, rows, n_K]
    if call.softcap is not None:
        scores = torch.tanh(scores / call.softcap) * call.softcap
    if call.position_bias is not None:
        bias = call.position_bias
        bias = bias[batch if bias.shape[0] > 1 else 0]  # [n_head or 1, n_Q, n_K]
        bias = bias[heads if bias.shape[0] > 1 else 0][..., start:stop, :call.n_K]
        scores = scores + bias.to(scores.dtype)
    scores = masked(call, scores, heads, batch, start, stop)
    if call.sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = call.sinks.reshape(-1)[heads].to(scores.dtype)  # [n_heads]
    sink = sink[:, None, None].expand(*scores.shape[:-1], 1)  # [n_heads, rows, 1]
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # rows sum to 1 - sink_weight


def masked(call: Call, scores: torch.Tensor, heads: torch.Tensor, batch: int, start: int,
           stop: int) -> torch.Tensor:
    """The scores with the call's mask applied: an additive mask added, a boolean one (True: may attend) and
    the causal or window rule filled with the dtype's minimum (eager's fill, so a row with no key allowed reads
    as eager's does)."""
    import torch

    floor = torch.finfo(scores.dtype).min
    mask = call.mask
    allowed = None
    n_Q, n_K = call.n_Q, call.n_K
    rows = torch.arange(start, stop, device=scores.device)[:, None]  # [rows, 1]
    cols = torch.arange(n_K, device=scores.device)[None, :]  # [1, n_K]
    if mask is not None and not hasattr(mask, "mask_mod") and mask.dim() == 4:
        grid = mask[batch if mask.shape[0] > 1 else 0][..., start:stop, :n_K]  # [1 or n_head, rows, n_K]
        grid = grid[heads.to(grid.device)] if grid.shape[0] > 1 else grid  # a mask per head: the heads asked
        if grid.dtype == torch.bool:
            allowed = grid
        else:
            scores = scores + grid.to(scores.dtype)
    elif mask is not None and hasattr(mask, "mask_mod"):  # flex attention's BlockMask: its mask_mod, evaluated
        b = torch.tensor(batch, device=scores.device)
        allowed = mask.mask_mod(b, torch.zeros((), dtype=torch.long, device=scores.device), rows, cols)
    elif mask is not None and mask.dim() == 2:  # flash's padding mask [n_batch, n_K]: 1 where a key is a token
        allowed = mask[batch, :n_K].bool()[None, :]
    if call.causal is not None:
        shift = n_K - n_Q if call.causal == "bottom-right" else 0
        rule = cols <= rows + shift
        if call.window is not None:
            rule = rule & (cols > rows + shift - call.window)
        allowed = rule if allowed is None else allowed & rule
    if allowed is None:
        return scores
    return scores.masked_fill(~allowed.to(scores.device), floor)
