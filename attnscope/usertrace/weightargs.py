"""A function that takes its weights as arguments: Phuong & Hutter's `attention(X, Z, W_q, W_k, W_v, mask)`, the
course notebooks' `self_attention(x, W_q, W_k, W_v, W_o)`.

Its weight parameters are the required ones named like weights (`W_q`, `w_k`, `Wv`, `W_o`, `weight_q`): trace gives
each a random nn.Parameter `[d_feat, d_feat]` (square, so `x @ W` and the column form's `W @ x` both run; which
side the weight stands on is read from the run, record.py) and traces the function as a module holding them, its
other parameters fed as a module's are (its inputs `[n_batch, n, d_feat]`, a mask). `--d-feat` sizes them.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

SHORT = ("wq", "wk", "wv", "wo", "wqkv", "wkv", "wqk")
DEFAULT_WIDTH = 12


def weight_names(fn: Any) -> list[str]:
    """The required parameters of `fn` named like weights, in order; [] where it takes none (or its signature
    cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            and p.kind != p.POSITIONAL_ONLY and _weight_like(p.name)]


def _weight_like(name: str) -> bool:
    lower = name.lower()
    return lower.startswith(("w_", "weight")) or lower in SHORT


def holding(fn: Any, d_feat: int | None, seed: int) -> Any:
    """An nn.Module holding a weight for each of `fn`'s weight parameters, whose forward takes `fn`'s other
    parameters and calls `fn` with them and its weights; None where `fn` takes no weights."""
    import torch
    from torch import nn

    names = weight_names(fn)
    if not names:
        return None
    signature = inspect.signature(fn)
    rest = [p for p in signature.parameters.values() if p.name not in names]
    width = d_feat or DEFAULT_WIDTH
    generator = torch.Generator().manual_seed(seed)

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs, **{name: getattr(self, name) for name in names})

    me = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(parameters=[me, *rest])  # type: ignore[attr-defined]
    forward.__name__ = forward.__qualname__ = getattr(fn, "__name__", "forward")
    holder = type(getattr(fn, "__name__", "weights"), (nn.Module,), {"forward": forward})()
    for name in names:
        # [d_feat, d_feat] / √d_feat: weights of unit-size outputs, drawn from the seed
        weight = torch.randn(width, width, generator=generator) / math.sqrt(width)
        holder.register_parameter(name, nn.Parameter(weight))
    return holder
