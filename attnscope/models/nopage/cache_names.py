"""The name transformers gives a forward's cache, whichever release is installed.

transformers 5.2x renamed a model forward's `past_key_values` argument and output field to `cache`; the old name
still works but warns ("`past_key_values` is deprecated and will be removed in version 5.40.0 ... Use `cache`
instead"), and releases before the rename know only `past_key_values`. attnscope asks the model which name its
forward takes (`inspect.signature`, as transformers' own `deprecate_kwarg` leaves the new name in the signature)
and reads the output under the new name where it is there, so decoding runs on every release pyproject allows.
"""

from __future__ import annotations

import inspect
from typing import Any


def cache_keyword(model: Any) -> str:
    """`cache` where the model's forward takes it, else `past_key_values`."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward inspect cannot read: the long-standing name
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def cache_of(out: Any) -> Any:
    """The cache a forward returned: `out.cache` where the output has that field, else `out.past_key_values`
    (None where neither is there)."""
    fields = getattr(out, "__dataclass_fields__", {})
    if "cache" in fields:
        return out.cache
    return getattr(out, "past_key_values", None)
