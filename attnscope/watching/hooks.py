"""Where `watch` listens, during its with-block only, and how it lets go.

- transformers' attention interface: every attention module of a family that calls it asks
  `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)` (or indexes the
  mapping) for its function on every forward. `AttentionInterface.get_interface` and `__getitem__` are wrapped so
  that the function handed back (eager, sdpa, flash, flex, or one the user registered) is the same function with a
  listener after it: it runs as it would have, its result is returned untouched, and then the module's inputs are
  handed to `on_call`. The backend is never changed.
- any `nn.Module`: `torch.nn.functional.scaled_dot_product_attention` is replaced by a function that calls the
  original and hands its inputs to `on_sdpa`. Code that imported the function by name before the with-block
  (`from torch.nn.functional import scaled_dot_product_attention`) keeps the original and is not seen.

`patched()` puts every original back on exit, also when the forward raised.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

MARK = "__attnscope_watched__"


def _listening(fn: Callable[..., Any], impl: str, on_call: Callable[..., None],
               made: dict[tuple[int, str], Callable[..., Any]]) -> Callable[..., Any]:
    """`fn` with the listener after it, made once per function and backend for the with-block (`made`)."""
    if getattr(fn, MARK, False):
        return fn
    key = (id(fn), impl)
    if key in made:
        return made[key]

    @functools.wraps(fn)
    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any,
                  **kwargs: Any) -> Any:
        result = fn(module, query, key, value, attention_mask, *args, **kwargs)
        if args:  # positional extras (no family passes them so): read by the function's own names
            import inspect

            bound = inspect.signature(fn).bind_partial(module, query, key, value, attention_mask, *args, **kwargs)
            kwargs = {name: v for name, v in bound.arguments.items()
                      if name not in ("module", "query", "key", "value", "attention_mask")}
            kwargs.update(kwargs.pop("kwargs", {}) or {})
        on_call(module, query, key, attention_mask, impl, kwargs)
        return result

    setattr(attention, MARK, True)
    made[key] = attention
    return attention


@contextmanager
def patched(on_call: Callable[..., None] | None, on_sdpa: Callable[..., None] | None) -> Iterator[None]:
    """The listeners in place for the block: `on_call(module, query, key, mask, implementation, kwargs)` at
    transformers' interface, `on_sdpa(query, key, attn_mask, is_causal, scale, enable_gqa)` at
    F.scaled_dot_product_attention."""
    import torch.nn.functional as F

    undo: list[Callable[[], None]] = []
    try:
        if on_call is not None:
            from transformers.modeling_utils import AttentionInterface

            get_interface, getitem = AttentionInterface.get_interface, AttentionInterface.__getitem__
            made: dict[tuple[int, str], Callable[..., Any]] = {}  # fn -> its listening wrapper, kept alive here

            def watched_get_interface(self: Any, attn_implementation: str, default: Callable[..., Any]) -> Any:
                return _listening(get_interface(self, attn_implementation, default), str(attn_implementation),
                                  on_call, made)

            def watched_getitem(self: Any, key: str) -> Any:
                return _listening(getitem(self, key), str(key), on_call, made)

            AttentionInterface.get_interface = watched_get_interface  # type: ignore[method-assign]
            AttentionInterface.__getitem__ = watched_getitem  # type: ignore[method-assign]

            def put_back() -> None:
                AttentionInterface.get_interface = get_interface  # type: ignore[method-assign]
                AttentionInterface.__getitem__ = getitem  # type: ignore[method-assign]

            undo.append(put_back)
        if on_sdpa is not None:
            original = F.scaled_dot_product_attention

            @functools.wraps(original)
            def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                                             dropout_p: float = 0.0, is_causal: bool = False, scale: Any = None,
                                             enable_gqa: bool = False, **more: Any) -> Any:
                out = original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                               scale=scale, enable_gqa=enable_gqa, **more)
                on_sdpa(query, key, attn_mask, is_causal, scale, enable_gqa)
                return out

            F.scaled_dot_product_attention = scaled_dot_product_attention

            def put_back_sdpa() -> None:
                F.scaled_dot_product_attention = original

            undo.append(put_back_sdpa)
        yield
    finally:
        for step in reversed(undo):
            step()
