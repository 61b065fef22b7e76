"""What a tensor file holds, read from its header: each tensor's name, shape, dtype and size, and a way to read
its data later. Nothing here reads a tensor's data until `Entry.read` is called, so `--meta` and the memory
guard work from the headers alone, whatever the file's size.

| format | header |
|---|---|
| `.npy` | the magic string and the header dict (`numpy.lib.format.read_array_header_1_0/2_0`) |
| `.npz` | the zip's directory, then each member's `.npy` header, inflating only those first bytes |
| `.safetensors` | the 8-byte length and the JSON header (the format's spec), offsets checked against the file |
| `.pt`, `.pth` | `torch.load(mmap=True, weights_only=True)`: the data stays on disk until used |
"""

from __future__ import annotations

import json
import math
import pickle
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError

if TYPE_CHECKING:
    import numpy as np
    import torch


@dataclass(frozen=True)
class Entry:
    """One tensor in a file, known from the header. `problem` says why it cannot be used (None when it can)."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None
    nbytes: int
    read: Callable[[], Any]  # the tensor, or a NumPy array
    problem: str | None = None


# A file whose first bytes are not its format's is not that format, whatever its name says.
MAGIC = {".npy": b"\x93NUMPY", ".npz": b"PK"}
PICKLED = "holds Python objects, which would run code when unpickled; refused"
SAFETENSORS_HEADER_LIMIT = 100_000_000  # bytes; the limit safetensors itself enforces


def check_magic(path: Path) -> None:
    magic = MAGIC[path.suffix.lower()]
    with open(path, "rb") as handle:
        if handle.read(len(magic)) != magic:
            raise UsageError(f"{path}: not a {path.suffix.lower()} file (it does not start with the format's header)")


# --- .npy and .npz: NumPy's own header ---------------------------------------------------------------


def npy_header(stream: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """Shape and dtype from an open `.npy` stream, which is left at the start of the data."""
    import numpy as np

    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, _, dtype = np.lib.format.read_array_header_2_0(stream)
    else:  # 3.0 exists only for records with non-Latin-1 field names, which are not numbers anyway
        raise ValueError(f"format version {version[0]}.{version[1]} holds records, not numbers")
    return tuple(int(n) for n in shape), dtype


def numpy_problem(dtype: np.dtype[Any]) -> str | None:
    """Why an array of this dtype cannot be an input (None when it can)."""
    if dtype.hasobject:
        return PICKLED
    if dtype.kind == "c":
        return complex_problem(str(dtype))
    if dtype.kind not in "biuf" or dtype.fields is not None:
        return f"holds an array of dtype {dtype.str!r}, not numbers; attention needs numbers"
    if dtype.kind == "f" and dtype.itemsize > 8:
        return f"holds {dtype.name}, which torch cannot hold; convert it to float64"
    return None


def complex_problem(name: str) -> str:
    return (f"holds complex numbers ({name}); attention here is over real numbers: save the part you mean "
            "(x.real, or x.abs() for the magnitude)")


def torch_dtype(dtype: np.dtype[Any]) -> torch.dtype:
    import numpy as np
    import torch

    return torch.from_numpy(np.empty(0, dtype.newbyteorder("="))).dtype


def native(array: Any) -> Any:
    """A big-endian array in this machine's byte order (torch reads only native order): converted, not refused."""
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def _numpy_entry(shape: tuple[int, ...], dtype: np.dtype[Any], read: Callable[[], Any]) -> Entry:
    problem = numpy_problem(dtype)
    size = math.prod(shape) * dtype.itemsize
    return Entry(shape, None if problem else torch_dtype(dtype), size, read, problem)


def npy_entries(path: Path) -> dict[str, Entry]:
    import numpy as np

    check_magic(path)
    with open(path, "rb") as handle:
        shape, dtype = npy_header(handle)
    return {"": _numpy_entry(shape, dtype, lambda: native(np.load(path, allow_pickle=False)))}


def npz_entries(path: Path) -> dict[str, Entry]:
    """Each `.npy` member by its name without `.npy` (as `numpy.load` names them), from its header only: a
    compressed member counts by the size it inflates to, known before inflating it."""
    import numpy as np

    check_magic(path)

    def reader(info: zipfile.ZipInfo) -> Callable[[], Any]:
        def read() -> Any:
            with zipfile.ZipFile(path) as archive, archive.open(info) as member:
                return native(np.lib.format.read_array(member, allow_pickle=False))
        return read

    entries = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                continue
            with archive.open(info) as member:
                shape, dtype = npy_header(member)
            entries[info.filename.removesuffix(".npy")] = _numpy_entry(shape, dtype, reader(info))
    return entries


# --- .safetensors: an 8-byte length and a JSON header ----------------------------------------------------

# The format's dtype names and the torch dtype each holds.
SAFETENSORS_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
                      "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16",
                      "BF16": "bfloat16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
                      "F8_E5M2": "float8_e5m2", "C64": "complex64"}


def safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header (its `__metadata__` included) and its length, checked for sense."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        start = handle.read(8)
        length = struct.unpack("<Q", start)[0] if len(start) == 8 else -1
        if not 0 < length <= min(SAFETENSORS_HEADER_LIMIT, size - 8):
            raise UsageError(f"{path}: not a valid .safetensors file (no header of a sensible length)")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise UsageError(f"{path}: not a valid .safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise UsageError(f"{path}: not a valid .safetensors file (its header is not a JSON object)")
    return header, length


def safetensors_entries(path: Path) -> dict[str, Entry]:
    import torch

    size = path.stat().st_size
    header, length = safetensors_header(path)

    def reader(name: str) -> Callable[[], Any]:
        def read() -> Any:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                return handle.get_tensor(name)
        return read

    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
            kind = str(info["dtype"])
        except (TypeError, KeyError, ValueError):
            raise UsageError(f"{path}: not a valid .safetensors file (tensor {name!r} has a malformed entry)") from None
        if not 0 <= begin <= end <= size - 8 - length:
            raise UsageError(f"{path}: truncated or damaged: tensor {name!r} lies beyond the end of the file")
        dtype = getattr(torch, SAFETENSORS_DTYPES.get(kind, "-"), None)
        if isinstance(dtype, torch.dtype):
            entries[name] = Entry(shape, dtype, end - begin, reader(name), dtype_problem(dtype))
        else:
            problem = f"holds a tensor of dtype {kind}, not one torch reads"
            entries[name] = Entry(shape, None, end - begin, reader(name), problem)
    return entries


def dtype_problem(dtype: torch.dtype) -> str | None:
    """Why a tensor of this dtype cannot be an input (None when it can)."""
    name = str(dtype).removeprefix("torch.")
    if dtype.is_complex:
        return complex_problem(name)
    if name.startswith("float8"):
        return (f"holds {name}, a storage format PyTorch's attention does not compute in; save it as float16, "
                "bfloat16 or float32 (tensor.float())")
    return None


# --- .pt / .pth: torch.load, memory-mapped ---------------------------------------------------------------


class HeaderUnreadable(UsageError):
    """A file whose shapes cannot be read apart from its data (torch's legacy .pt). `size` is the file's size,
    about what loading it takes: what a memory guard can count before reading it."""

    def __init__(self, message: str, size: int, *params: str) -> None:
        super().__init__(message, *params)
        self.size = size


def torch_entries(path: Path, *, meta: bool, fits: Callable[[int], None]) -> dict[str, Entry]:
    """`torch.load(mmap=True, weights_only=True)` maps the file: shapes and dtypes without reading the data.
    A file in torch's legacy (pre-1.6) format cannot be mapped: it is read whole when it fits in memory
    (`fits` refuses it otherwise), and refused under --meta, which reads headers only."""
    import torch

    try:
        loaded = _torch_load(path, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        if meta:
            raise HeaderUnreadable(f"{path}: saved in torch's legacy format, which cannot be read without loading "
                                   "it all, and {meta} reads headers only; save it again with torch.save, or drop "
                                   "{meta}", path.stat().st_size, "meta") from None
        fits(path.stat().st_size)
        loaded = _torch_load(path, mmap=False)
    if isinstance(loaded, torch.Tensor):
        found = {"": loaded}
    elif isinstance(loaded, dict) and any(isinstance(v, torch.Tensor) for v in loaded.values()):
        found = {str(k): v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    else:
        raise UsageError(f"{path}: holds a {type(loaded).__name__}, not a tensor or a dict of tensors")
    return {name: Entry(tuple(t.shape), t.dtype, t.numel() * t.element_size(), _constant(t), torch_problem(t, meta))
            for name, t in found.items()}


def _constant(tensor: torch.Tensor) -> Callable[[], Any]:
    return lambda: tensor


def torch_problem(tensor: torch.Tensor, meta: bool) -> str | None:
    import torch

    if tensor.layout != torch.strided:
        layout = str(tensor.layout).removeprefix("torch.")
        return f"holds a sparse tensor ({layout}); save it dense (tensor.to_dense())"
    if tensor.is_quantized:
        name = str(tensor.dtype).removeprefix("torch.")
        return f"holds a quantized tensor ({name}); save it dequantized (tensor.dequantize())"
    if tensor.device.type == "meta" and not meta:
        return "holds a meta tensor (a shape with no values); save real tensors, or use --meta for shapes only"
    return dtype_problem(tensor.dtype)


def _torch_load(path: Path, *, mmap: bool) -> Any:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        # torch names the class or function the file would call ("Unsupported global: ..."); anything
        # else it could not unpickle is simply not a torch file.
        if "global" not in str(exc).lower():
            raise UsageError(f"{path}: not a readable .pt file (torch.load could not read it)") from None
        raise UsageError(
            f"{path}: refused: it holds Python objects that would run code when unpickled (torch.load with "
            "weights_only=True rejected it); save plain tensors or a dict of them, or convert it to .safetensors"
        ) from None
