"""Names whose code is written in another file (trace_styles_elsewhere_base.py), for tests/test_trace_elsewhere.py:
a subclass that inherits its forward, the class imported under its own name, a function imported, and torch's own
nn.MultiheadAttention bound to a name."""

from torch import nn
from trace_styles_elsewhere_base import FusedCausalAttention, attend

__all__ = ["Attention", "FusedCausalAttention", "attend", "TorchAttention", "Wrapped"]


class Attention(FusedCausalAttention):
    """Everything inherited: its forward runs in trace_styles_elsewhere_base.py."""


class Wrapped(FusedCausalAttention):
    """A forward of its own that hands the work to the base's: recorded here, the base as a helper beside it."""

    def forward(self, x):
        return super().forward(x)


TorchAttention = nn.MultiheadAttention
