"""The explorer page's numbers, stored compactly and exactly to the digits it shows.

Every pattern (a head's `[n_Q, n_K]`, a pooled pattern, an exact row, a decode step's `[n_head, n_K]`) is
stored as whole numbers of one decimal unit, `value = (lo + q) * 10**exp` with `q` an unsigned 16-bit
integer (65535 marks a weight that is not finite): the page shows `lo + q` with the decimal point put in
place, so what it shows is the run's weight rounded to `-exp` decimals, the digits `--json` gives rounded
the same way (NumPy's `rint`: half to even). `exp` is the page's (4 decimals, `-4`), or a larger one for an
array whose range does not fit 65535 units of it.

The arrays of one group (a layer, the decode steps) are laid end to end, their low bytes first and their high
bytes after (the high bytes of attention weights, almost all small, are almost all 0 and compress to
nothing), compressed with zlib (deflate, which the browser's own `DecompressionStream('deflate')` reads) and
written in base64.

A page that would pass `budget` characters of data is packed again a decimal coarser (4, then 3, then 2
decimals): MiniLM's every layer and head at 512 tokens takes about 14 MB at 4 decimals and 7 MB at 3
(docs/performance.md).
"""

from __future__ import annotations

import base64
import math
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor

NOT_FINITE = 65535  # q of a NaN or infinite weight
MOST = 65534  # the largest q of a finite weight
DECIMALS = (4, 3, 2)  # tried in order until the data fits the budget
LEVEL = 6  # zlib's default: level 9 saves 1% here and takes three times as long


@dataclass
class Packer:
    """Collects arrays into named groups; `add` returns the reference the page reads an array back by (its
    `lo` and `exp` are filled in when its group is packed: a group is quantized and compressed only once asked
    for, so that a first estimate costs one group)."""

    exp: int = -4
    groups: dict[str, list[tuple[Any, dict[str, Any]]]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    _packed: dict[str, str] = field(default_factory=dict)

    def add(self, group: str, values: Tensor | np.ndarray) -> dict[str, Any]:
        at = self.sizes.get(group, 0)
        ref = {"group": group, "at": at, "shape": list(values.shape), "lo": 0, "exp": self.exp}
        self.groups.setdefault(group, []).append((values, ref))
        self.sizes[group] = at + math.prod(values.shape)
        return ref

    def estimate(self) -> int:
        """The characters all groups will take, extrapolated from the largest one alone (packed, and kept)."""
        if not self.sizes:
            return 0
        largest = max(self.sizes, key=self.sizes.__getitem__)
        return len(self._pack(largest)) * sum(self.sizes.values()) // max(self.sizes[largest], 1)

    def blobs(self) -> dict[str, str]:
        """Each group as base64 of the deflated low bytes, then high bytes, of its values (zlib releases the
        GIL, so the groups are packed side by side)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor() as pool:
            return dict(zip(self.groups, pool.map(self._pack, self.groups), strict=True))

    def _pack(self, group: str) -> str:
        if group not in self._packed:
            parts = []
            for values, ref in self.groups[group]:
                q, ref["lo"], ref["exp"] = quantize(_as_float64(values), self.exp)
                parts.append(q.ravel())
            planes = np.concatenate(parts).astype("<u2").view(np.uint8).reshape(-1, 2).T  # [2, n]: low, high bytes
            self._packed[group] = base64.b64encode(zlib.compress(planes.tobytes(), LEVEL)).decode("ascii")
        return self._packed[group]


def quantize(array: np.ndarray, exp: int) -> tuple[np.ndarray, int, int]:
    """`array` as `(q, lo, exp)`: `q` uint16 with `value ≈ (lo + q) * 10**exp`, rounded half to even; `exp`
    raised until the finite values' range fits 65535 units."""
    finite = np.isfinite(array)
    while True:
        units = np.rint(array * 10.0 ** -exp) if exp <= 0 else np.rint(array / 10.0 ** exp)
        if not finite.any():
            return np.full(array.shape, NOT_FINITE, np.uint16), 0, exp
        low, high = float(units[finite].min()), float(units[finite].max())
        lo = min(0, int(low))
        if high - lo <= MOST:
            q = np.where(finite, units - lo, NOT_FINITE)
            return q.astype(np.uint16), lo, exp
        exp += max(1, math.ceil(math.log10((high - lo) / MOST)))


def unpack(blob: str, ref: dict[str, Any]) -> np.ndarray:
    """What the page reads back for `ref` (float64, NaN where not finite): for tests and for checking."""
    raw = np.frombuffer(zlib.decompress(base64.b64decode(blob)), np.uint8)
    n = raw.size // 2
    q = (raw[:n].astype(np.uint32) | (raw[n:].astype(np.uint32) << 8))
    size = math.prod(ref["shape"])
    part = q[ref["at"]: ref["at"] + size].astype(np.float64)
    values = (ref["lo"] + part) * 10.0 ** ref["exp"]
    values[part == NOT_FINITE] = np.nan
    return values.reshape(ref["shape"])  # [size] -> ref["shape"]


def shown(value: float, exp: int) -> str:
    """How the page writes a weight stored with `exp`: `0.1234` for -4 (what `unpack` gives, as text)."""
    if not math.isfinite(value):
        return "not finite"
    return f"{value:.{max(0, -exp)}f}"


def _as_float64(values: Tensor | np.ndarray) -> np.ndarray:
    if not isinstance(values, np.ndarray):
        import torch

        tensor = values.detach().cpu()
        values = (tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()).numpy()
    return values.astype(np.float64, copy=False)
