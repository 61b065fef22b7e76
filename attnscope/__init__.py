"""attnscope: run attention and see every intermediate tensor.

The public API is imported lazily (PEP 562) so `attnscope --help` never pays for importing torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from attnscope import trace as _trace
from attnscope.readings import headstats as _headstats

__version__ = "0.1.0"

__all__ = [
    "AttnscopeError",
    "Latent",
    "LatentAttention",
    "MultiHeadAttention",
    "QkNorm",
    "Rope",
    "Step",
    "TemperatureTuning",
    "Trace",
    "load_tensor",
    "model_head",
    "save_tensors",
    "sdpa",
    "split_heads",
    "merge_heads",
    "watch",
]

_HOMES = {
    "AttnscopeError": "attnscope.errors",
    "MultiHeadAttention": "attnscope.attention.multihead",
    "Latent": "attnscope.spec",
    "LatentAttention": "attnscope.attention.latent",
    "QkNorm": "attnscope.variants.qknorm",
    "Rope": "attnscope.variants.rope",
    "sdpa": "attnscope.attention.dot_product",
    "split_heads": "attnscope.attention.stages",
    "merge_heads": "attnscope.attention.stages",
    "Step": "attnscope.trace",
    "TemperatureTuning": "attnscope.variants.temperature",
    "Trace": "attnscope.trace",
    "load_tensor": "attnscope.tensors",
    "model_head": "attnscope.runs.head",
    "save_tensors": "attnscope.tensors",
    "watch": "attnscope.watching",  # not a package named watch: importing it would make attnscope.watch the module
}

if TYPE_CHECKING:
    from attnscope.attention.dot_product import sdpa
    from attnscope.attention.latent import LatentAttention
    from attnscope.attention.multihead import MultiHeadAttention
    from attnscope.attention.stages import merge_heads, split_heads
    from attnscope.errors import AttnscopeError
    from attnscope.readings.headstats import LayerHeads
    from attnscope.runs.head import model_head
    from attnscope.spec import Latent
    from attnscope.tensors import load_tensor, save_tensors
    from attnscope.trace import Step, Trace
    from attnscope.variants.qknorm import QkNorm
    from attnscope.variants.rope import Rope
    from attnscope.variants.temperature import TemperatureTuning
    from attnscope.watching import watch


def _notebook_view(trace: Trace) -> str:
    """A trace in Jupyter: its steps and its attention, each head's kind read (views/embed.py, readings/)."""
    from attnscope.readings.headstats import describe
    from attnscope.views.embed import trace_view

    return trace_view(trace, describe)


def _heads_view(layer: LayerHeads) -> str:
    """Every head of a layer in Jupyter (views/embed.py)."""
    from attnscope.views.embed import heads_view

    return heads_view(layer)


_trace.Trace.notebook_view = _notebook_view  # the core's Trace shows itself through the views, which it never imports
_headstats.LayerHeads.notebook_view = _heads_view  # and so does readings/' LayerHeads


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'attnscope' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
