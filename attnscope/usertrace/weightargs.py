"""A function that takes its weights as arguments: Phuong & Hutter's `attention(X, Z, W_q, W_k, W_v, mask)`, the
course notebooks' `self_attention(x, W_q, W_k, W_v, W_o)`.

Its weight parameters are the required ones named like weights (`W_q`, `w_k`, `Wv`, `W_o`, `weight_q`): trace gives
each a random nn.Parameter `[d_feat, d_feat]` (square, so `x @ W` and the column form's `W @ x` both run; which
side the weight stands on is read from the run, record.py) and traces the function as a module holding them, its
other parameters fed as a module's are (its inputs `[n_batch, n, d_feat]`, a mask). `--d-feat` sizes them. Where
its size parameters (`n_head`, `d_head`, `d_model`) say n_head·d_head ≠ d_feat, the weights are `[d_feat,
n_head·d_head]` (`W_o` the other way), turned where the code reads them as `F.linear` does.
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


# a function's size parameters, by the size they take: its head count, a head's width, the model's width
SIZE_NAMES = {"n_head": ("n_head", "n_heads", "num_heads", "heads", "nhead", "num_attention_heads", "head_count"),
              "d_head": ("head_dim", "d_head", "head_size", "d_k", "dim_head", "attention_head_size"),
              "d_feat": ("d_model", "d_feat", "embed_dim", "hidden_size", "n_embd", "model_dim", "emb_dim")}
OUT_NAMES = ("w_o", "wo", "weight_o", "w_out", "weight_out", "w_proj")


def size_params(fn: Any) -> dict[str, tuple[str, int | None]]:
    """`fn`'s parameters named like a size (`n_head`, `d_head`, `d_model`, ...): name -> (the size, its default, or
    None where it is required)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return {}
    found: dict[str, tuple[str, int | None]] = {}
    for p in params:
        size = next((k for k, names in SIZE_NAMES.items() if p.name.lower() in names), None)
        default = p.default
        if size is None or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            continue
        if default is p.empty:
            found[p.name] = (size, None)
        elif isinstance(default, int) and not isinstance(default, bool) and default > 0:
            found[p.name] = (size, default)
    return found


def holding(fn: Any, d_feat: int | None, seed: int, heads: int | None = None) -> Any:
    """An nn.Module holding a weight for each of `fn`'s weight parameters, whose forward takes `fn`'s other
    parameters and calls `fn` with them and its weights; None where `fn` takes no weights.

    Its size parameters (`n_head`, `d_head`, `d_model`) say the weights' shapes: W_q, W_k, W_v `[d_feat, n_head·d_head]`
    (as `x @ W` reads them; `transpose` turns them for `F.linear(x, W)` and `W @ x`), W_o `[n_head·d_head, d_feat]`,
    square where they say nothing. A required one is given by the holder (--heads, else a head count that divides
    the width), and each is kept as the holder's attribute, where the head count is read as a module's is."""
    import torch
    from torch import nn

    names = weight_names(fn)
    if not names:
        return None
    signature = inspect.signature(fn)
    sized = size_params(fn)
    defaults = {size: value for size, value in sized.values() if value is not None}
    width = d_feat or defaults.get("d_feat") or DEFAULT_WIDTH
    n_head = heads or defaults.get("n_head")
    d_head = defaults.get("d_head")
    required = {name: size for name, (size, value) in sized.items() if value is None}
    if n_head is None and "n_head" in required.values():
        n_head = next((h for h in (4, 2, 3, 1) if width % h == 0 and (d_head is None or True)), 1)
    if d_head is None and n_head and "d_head" in required.values():
        d_head = width // n_head if width % n_head == 0 else width
    given = {name: {"n_head": n_head, "d_head": d_head, "d_feat": width}[size] for name, size in required.items()}
    inner = n_head * d_head if n_head and d_head else width
    rest = [p for p in signature.parameters.values() if p.name not in names and p.name not in given]
    generator = torch.Generator().manual_seed(seed)

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs, **{name: getattr(self, name) for name in names}, **given)

    me = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(parameters=[me, *rest])  # type: ignore[attr-defined]
    forward.__name__ = forward.__qualname__ = getattr(fn, "__name__", "forward")
    holder = type(getattr(fn, "__name__", "weights"), (nn.Module,), {"forward": forward})()
    for name in names:
        out = name.lower() in OUT_NAMES
        fused = 3 if name.lower().endswith("qkv") else 2 if name.lower().endswith(("kv", "qk")) else 1
        shape = (inner, width) if out else (width, fused * inner)
        # [d_in, d_out] / √d_in: weights of unit-size outputs, drawn from the seed
        weight = torch.randn(*shape, generator=generator) / math.sqrt(shape[0])
        holder.register_parameter(name, nn.Parameter(weight))
    for size, value in (("n_head", n_head), ("d_head", d_head)):
        if value:
            setattr(holder, size, value)
    return holder


def square(holder: Any) -> bool:
    """Whether every weight the holder gave is square (both sides of a matmul read it alike)."""
    return all(p.shape[0] == p.shape[1] for p in holder.parameters())


def transpose(holder: Any) -> None:
    """The holder's weights turned, `[d_in, d_out]` <-> `[d_out, d_in]`: for code that reads them as `F.linear(x, W)`
    or `W @ x` does."""
    from torch import nn

    for name, p in list(holder.named_parameters()):
        holder.register_parameter(name, nn.Parameter(p.detach().t().contiguous()))
