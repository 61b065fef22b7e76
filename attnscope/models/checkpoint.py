"""Reading a checkpoint lazily: key names from the header, one head's slices without loading the rest.

safetensors files are opened lazily and read as NumPy arrays where the dtype allows, so a weight dump
imports neither torch nor transformers; `pytorch_model.bin` is memory-mapped through torch and never
unpickles code.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError

if TYPE_CHECKING:
    import numpy as np
    import torch

    Array = np.ndarray | torch.Tensor

# safetensors dtypes NumPy can hold; the rest (BF16, F8_*) are read through torch.
NUMPY_DTYPES = frozenset({"F64", "F32", "F16", "I64", "I32", "I16", "I8", "U8", "BOOL"})


def keys(weights: Path) -> list[str]:
    if weights.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(weights), framework="numpy") as handle:  # reads the header only
                return list(handle.keys())
        except SafetensorError as exc:
            raise UsageError(f"{weights}: not a valid safetensors file ({exc})") from None
    return list(load_bin(weights))


def load_bin(weights: Path) -> dict[str, torch.Tensor]:
    """pytorch_model.bin, memory-mapped (only the slices read are paged in) and never unpickling code."""
    import pickle

    import torch

    try:
        return torch.load(weights, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise UsageError(f"{weights}: refused: it would run code when unpickled (torch.load with "
                         "weights_only=True rejected it); convert the checkpoint to model.safetensors") from None
    except (RuntimeError, OSError, EOFError) as exc:
        raise UsageError(f"{weights}: not a readable checkpoint ({str(exc).splitlines()[0][:120]})") from None


class Reader:
    """A context giving `read(key, axis, lo, hi) -> (array, slice text)` over either weight format."""

    def __init__(self, weights: Path) -> None:
        self.weights = weights
        self._handles: dict[str, Any] = {}
        self._state: dict[str, torch.Tensor] | None = None

    def __enter__(self) -> Any:
        if self.weights.suffix != ".safetensors":
            self._state = load_bin(self.weights)
        return self.read

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles.values():
            handle.__exit__(*exc)
        self._state = None

    def _handle(self, framework: str) -> Any:
        if framework not in self._handles:
            from safetensors import safe_open

            handle = safe_open(str(self.weights), framework=framework)
            handle.__enter__()
            self._handles[framework] = handle
        return self._handles[framework]

    def read(self, key: str, axis: str, lo: int, hi: int) -> tuple[Array, str]:
        try:
            if self._state is None:
                whole = self._handle("numpy").get_slice(key)
                if whole.get_dtype() not in NUMPY_DTYPES:
                    whole = self._handle("pt").get_slice(key)
                rank = len(whole.get_shape())
                tensor = whole[lo:hi] if axis == "rows" or rank == 1 else whole[:, lo:hi]
            else:
                state = self._state[key]
                rank = state.dim()
                tensor = (state[lo:hi] if axis == "rows" or rank == 1 else state[:, lo:hi]).clone()
        except KeyError:
            raise UsageError(f"{self.weights}: no tensor {key}; the checkpoint is incomplete") from None
        text = f"[{lo}:{hi}]" if rank == 1 else (f"[{lo}:{hi}, :]" if axis == "rows" else f"[:, {lo}:{hi}]")
        return tensor, text


def as_float64(tensor: Array) -> np.ndarray:
    import numpy as np

    if isinstance(tensor, np.ndarray):
        return tensor.astype(np.float64)
    return tensor.detach().double().numpy()


def weight_stats(tensor: Array) -> dict[str, float]:
    """mean, std (unbiased, as torch.std) and Frobenius norm, computed in float64."""
    import numpy as np

    values = as_float64(tensor)
    std = float(values.std(ddof=1)) if values.size > 1 else 0.0
    return {"mean": float(values.mean()), "std": std, "norm": float(np.linalg.norm(values))}


def describe(tensor: Array) -> tuple[list[int], str, int]:
    """shape, dtype name and bytes, the same for a NumPy array and a torch tensor."""
    import numpy as np

    if isinstance(tensor, np.ndarray):
        return list(tensor.shape), str(tensor.dtype), int(tensor.nbytes)
    return list(tensor.shape), str(tensor.dtype).removeprefix("torch."), tensor.numel() * tensor.element_size()
