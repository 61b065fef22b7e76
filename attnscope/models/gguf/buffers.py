"""Float32 arrays for weights expanded at each use (models/gguf/expand.py), handed out again once nothing holds
them: a decoding run expands every layer's matrices at every token, and fresh allocations of that volume (half a
GB a token for SmolLM2-135M) either stay in the C heap, fragmented (100 MiB over what is live, measured), or are
mapped and zero-filled page by page each time (several seconds of system time over 16 tokens).

Whether an array is free is read from its reference count: `torch.from_numpy` holds one reference for as long as
the tensor's storage lives, whatever aliases the caller made of it (an nn.Parameter, a transpose, a view), so an
array whose only references are the pool's own is held by no tensor.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

OWN = 3  # getrefcount's references to a free array: the pool's list, the loop's name, getrefcount's argument


class Buffers:
    """Float32 arrays by shape, each handed out as a tensor while no earlier tensor of it lives."""

    def __init__(self) -> None:
        self._arrays: dict[tuple[int, int], list[np.ndarray]] = {}

    def take(self, rows: int, cols: int) -> torch.Tensor:
        """An uninitialised float32 tensor `[rows, cols]` over an array no live tensor holds (a new one if all are
        held)."""
        import numpy as np
        import torch

        arrays = self._arrays.setdefault((rows, cols), [])
        for array in arrays:
            if sys.getrefcount(array) <= OWN:
                return torch.from_numpy(array)
        arrays.append(np.empty((rows, cols), dtype=np.float32))
        return torch.from_numpy(arrays[-1])

    def clear(self) -> None:
        self._arrays.clear()
