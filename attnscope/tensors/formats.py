"""What a tensor file holds, read from its header: each tensor's name, shape, dtype and size, and a way to read
its data later. Nothing here reads a tensor's data until `Entry.read` is called, so `--meta` and the memory
guard work from the headers alone, whatever the file's size.

| format | header |
|---|---|
| `.npy` | the magic string and the header dict (`numpy.lib.format.read_array_header_1_0/2_0`) |
| `.npz` | the zip's directory, then each member's `.npy` header, inflating only those first bytes |
| `.safetensors` | the 8-byte length and the JSON header (the format's spec), checked as safetensors checks it |
| `.pt`, `.pth` | `torch.load(weights_only=True)` onto the meta device, once; the data mapped when used |

Every header is checked against the bytes the file holds before any data is read: a header that declares more
than its data holds is one line here (exit 2), not an error from the reader later, whichever command reads it.
Within a command's run each file is opened once, however many flags name it (opened.py).
"""

from __future__ import annotations

import json
import math
import pickle
import struct
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from attnscope.errors import UsageError
from attnscope.tensors.opened import opened

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


def _numpy_entry(where: str, shape: tuple[int, ...], dtype: np.dtype[Any], held: int,
                 read: Callable[[], Any]) -> Entry:
    """`held`: the bytes after the header, which must hold what the header declares (numpy.load finds out only
    when it reads them: "Failed to read all data for array")."""
    problem = numpy_problem(dtype)
    size = math.prod(shape) * dtype.itemsize
    if size > held and not problem:
        raise UsageError(f"{where}: truncated or damaged: its header declares {list(shape)} {dtype.name} "
                         f"({size:,} bytes) but only {held:,} bytes of data follow it; write the file again")
    return Entry(shape, None if problem else torch_dtype(dtype), size, read, problem)


def npy_entries(path: Path) -> dict[str, Entry]:
    import numpy as np

    check_magic(path)
    with open(path, "rb") as handle:
        shape, dtype = npy_header(handle)
        held = path.stat().st_size - handle.tell()
    return {"": _numpy_entry(str(path), shape, dtype, held, lambda: native(np.load(path, allow_pickle=False)))}


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
                held = info.file_size - member.tell()  # the member's inflated size, from the zip's directory
            name = info.filename.removesuffix(".npy")
            entries[name] = _numpy_entry(f"{path}:{name}", shape, dtype, held, reader(info))
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

    entries, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            _check_metadata(path, info)
            continue
        try:
            shape, (begin, end), kind = _naturals(info["shape"]), _naturals(info["data_offsets"]), str(info["dtype"])
        except (TypeError, KeyError, ValueError):
            raise UsageError(f"{path}: not a valid .safetensors file (tensor {name!r} has a malformed entry)") from None
        if not 0 <= begin <= end <= size - 8 - length:
            raise UsageError(f"{path}: truncated or damaged: tensor {name!r} lies beyond the end of the file")
        dtype = getattr(torch, SAFETENSORS_DTYPES.get(kind, "-"), None)
        if isinstance(dtype, torch.dtype):
            if math.prod(shape) * dtype.itemsize != end - begin:
                raise UsageError(f"{path}: truncated or damaged: tensor {name!r} is declared {list(shape)} {kind} "
                                 f"({math.prod(shape) * dtype.itemsize:,} bytes) but holds {end - begin:,} bytes")
            entries[name] = Entry(shape, dtype, end - begin, reader(name), dtype_problem(dtype))
        else:
            problem = f"holds a tensor of dtype {kind}, not one torch reads"
            entries[name] = Entry(shape, None, end - begin, reader(name), problem)
        spans.append((begin, end, name))
    _check_spans(path, spans, size - 8 - length)
    return entries


def _naturals(value: Any) -> tuple[int, ...]:
    """A JSON list of whole numbers of 0 or more (safetensors reads them as usize), else ValueError."""
    if not isinstance(value, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in value):
        raise ValueError(value)
    return tuple(value)


def _check_metadata(path: Path, metadata: Any) -> None:
    """`__metadata__` is a map of strings to strings (safetensors' `Metadata`), or null."""
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str)
                                                                          for v in metadata.values())):
        raise UsageError(f"{path}: not a valid .safetensors file (its __metadata__ is not a map of strings)")


def _check_spans(path: Path, spans: list[tuple[int, int, str]], data_size: int) -> None:
    """The tensors' bytes, in the order of their offsets, follow one another from 0 to the end of the file, with no
    gap and no overlap: what safetensors' own reader checks before it reads any tensor (`Metadata::validate` and
    `read_metadata` in safetensors' tensor.rs: "invalid offset", "file not fully covered")."""
    end, before = 0, "the data begins"
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise UsageError(f"{path}: truncated or damaged: tensor {name!r} starts at byte {begin:,} of the data, "
                             f"not at {end:,} where {before}")
        end, before = stop, f"tensor {name!r} ends"
    if end != data_size:
        raise UsageError(f"{path}: not a valid .safetensors file (its tensors take {end:,} bytes of the "
                         f"{data_size:,} after the header)")


def dtype_problem(dtype: torch.dtype) -> str | None:
    """Why a tensor of this dtype cannot be an input (None when it can)."""
    name = str(dtype).removeprefix("torch.")
    if dtype.is_complex:
        return complex_problem(name)
    if name.startswith("float8"):
        return (f"holds {name}, a storage format PyTorch's attention does not compute in; save it as float16, "
                "bfloat16 or float32 (tensor.float())")
    return None


# --- .pt / .pth: the pickle read once, the data memory-mapped ----------------------------------------------


class HeaderUnreadable(UsageError):
    """A file whose shapes cannot be read apart from its data (torch's legacy .pt). `size` is the file's size,
    about what loading it takes: what a memory guard can count before reading it."""

    def __init__(self, message: str, size: int, *params: str) -> None:
        super().__init__(message, *params)
        self.size = size


def torch_entries(path: Path, *, meta: bool, fits: Callable[[int], None]) -> dict[str, Entry]:
    return torch_contents(path, meta=meta, fits=fits)[0]


def torch_contents(path: Path, *, meta: bool, fits: Callable[[int], None]) -> tuple[dict[str, Entry], Any]:
    """The file's entries and the object its pickle holds, from one `torch.load(weights_only=True)`.

    The pickle is read once onto the meta device: shapes, dtypes and where each storage lies in the archive
    (`_checkpoint_offset`), no data. A tensor's data is read only when asked, from the file mapped as
    `torch.load(mmap=True)` maps it. A file saved on the other byte order, or holding a quantized tensor (no meta
    form), is mapped by torch.load itself, its storages unchecked against their records. A file in torch's legacy
    (pre-1.6) format cannot be mapped: it is read whole when it fits in memory (`fits` refuses it otherwise), and
    refused under --meta, which reads headers only."""
    with open(path, "rb") as handle:
        archive = handle.read(4) == b"PK\x03\x04"  # torch.serialization._is_zipfile's test
    if not archive and meta:
        raise HeaderUnreadable(f"{path}: saved in torch's legacy format, which cannot be read without loading "
                               "it all, and {meta} reads headers only; save it again with torch.save, or drop "
                               "{meta}", path.stat().st_size, "meta")
    # once per command (opened.py): the guard's read and each flag naming the file share one unpickling
    loaded, mapped = opened(path, "torch", lambda: _torch_opened(path, archive, fits))
    return _torch_found(path, loaded, meta, mapped), loaded


def _torch_opened(path: Path, archive: bool, fits: Callable[[int], None]) -> tuple[Any, _Mapped | None]:
    """The object the pickle holds and, where it was read onto the meta device, the mapped file its data is
    read from (None where torch.load read or mapped the data itself)."""
    if not archive:
        fits(path.stat().st_size)
        return _torch_load(path, mmap=False), None
    mapped = _Mapped(path)
    if mapped.byteorder not in (None, sys.byteorder):
        # torch.load swaps each storage of a file saved on the other byte order, a meta one too, and that
        # crashes the process (a segmentation fault, torch 2.13): such a file is mapped and swapped by torch
        return _torch_load(path, mmap=True), None
    try:
        return _torch_load(path, meta=True), mapped
    except (RuntimeError, NotImplementedError):  # a quantized tensor has no meta form: torch_problem refuses it
        return _torch_load(path, mmap=True), None


def _torch_found(path: Path, loaded: Any, meta: bool, mapped: _Mapped | None) -> dict[str, Entry]:
    """Entries for the tensors `loaded` holds: read through `mapped` where the pickle was read onto the meta
    device, else the loaded tensors themselves."""
    import torch

    if isinstance(loaded, torch.Tensor):
        found = {"": loaded}
    elif isinstance(loaded, dict) and any(isinstance(v, torch.Tensor) for v in loaded.values()):
        found = {str(k): v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    else:
        raise UsageError(f"{path}: holds a {type(loaded).__name__}, not a tensor or a dict of tensors")
    entries = {}
    for name, t in found.items():
        read = mapped.reader(t) if mapped else None  # raises for a storage its record cannot hold
        empty = t.device.type == "meta" and read is None  # saved on the meta device: a shape with no values
        entries[name] = Entry(tuple(t.shape), t.dtype, t.numel() * t.element_size(), read or _constant(t),
                              torch_problem(t, meta, empty))
    return entries


class _Mapped:
    """The archive's stored records, and its tensors' data read from the file mapped as `torch.load(mmap=True)`
    maps it (`UntypedStorage.from_file`, then each storage a slice at its record's offset: `load_tensor` in
    torch/serialization.py). Each storage must lie inside its record: torch's mapped load checks it against
    nothing but the file's end, so a storage larger than its record would read the records after it (the unmapped
    load says "record size ... does not match", `get_storage_from_record`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.held: dict[int, int] = {}  # offset of a record's data -> its size
        with zipfile.ZipFile(path) as archive, open(path, "rb") as handle:
            for info in archive.infolist():
                handle.seek(info.header_offset + 26)  # the local header: 30 bytes, then the name and extra field
                name_length, extra_length = struct.unpack("<HH", handle.read(4))
                if info.compress_type == zipfile.ZIP_STORED:
                    self.held[info.header_offset + 30 + name_length + extra_length] = info.file_size
            order = [name for name in archive.namelist() if name.endswith("/byteorder")]
            self.byteorder = archive.read(order[0]).decode() if order else None
        self.whole: torch.UntypedStorage | None = None
        self.storages: dict[int, torch.UntypedStorage] = {}

    def reader(self, tensor: torch.Tensor) -> Callable[[], Any] | None:
        """What reads `tensor`'s data (a meta tensor from the pickle); raises now for a storage its record cannot
        hold. None for a tensor with no storage in the file: one saved on the meta device, or a sparse one."""
        import torch

        if tensor.layout != torch.strided:
            return None
        storage = tensor.untyped_storage()
        offset = getattr(storage, "_checkpoint_offset", None)
        if offset is None:
            return None
        if offset not in self.held or storage.nbytes() > self.held[offset]:
            held = (f"its record in the archive holds {self.held[offset]:,}" if offset in self.held
                    else "no record in the archive starts where it does")
            raise UsageError(f"{self.path}: truncated or damaged: a tensor's storage is declared "
                             f"{storage.nbytes():,} bytes but {held}; save it again")
        return lambda: self._read(tensor, offset, storage.nbytes())

    def _read(self, tensor: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
        import torch

        if offset not in self.storages:  # a storage shared by several tensors is sliced once
            if self.whole is None:  # the file mapped private, as torch.load(mmap=True) maps it
                mapped = torch.UntypedStorage.from_file(str(self.path), False, self.path.stat().st_size)
                self.whole = cast("torch.UntypedStorage", mapped)
            self.storages[offset] = self.whole[offset:offset + nbytes]
        # torch._utils._rebuild_tensor: an empty tensor set to the storage, offset, size and stride
        out = torch.empty((0,), dtype=tensor.dtype).set_(self.storages[offset], tensor.storage_offset(),
                                                          tensor.shape, tensor.stride())
        return torch._neg_view(out) if tensor.is_neg() else out.conj() if tensor.is_conj() else out


def _constant(tensor: torch.Tensor) -> Callable[[], Any]:
    return lambda: tensor.detach()  # a new tensor on the same data each time: the file may be read once a command


def torch_problem(tensor: torch.Tensor, meta: bool, empty: bool) -> str | None:
    import torch

    if tensor.layout != torch.strided:
        layout = str(tensor.layout).removeprefix("torch.")
        return f"holds a sparse tensor ({layout}); save it dense (tensor.to_dense())"
    if tensor.is_quantized:
        name = str(tensor.dtype).removeprefix("torch.")
        return f"holds a quantized tensor ({name}); save it dequantized (tensor.dequantize())"
    if empty and not meta:
        return "holds a meta tensor (a shape with no values); save real tensors, or use --meta for shapes only"
    return dtype_problem(tensor.dtype)


def _torch_load(path: Path, *, mmap: bool = False, meta: bool = False) -> Any:
    """`torch.load(weights_only=True)`, onto the meta device (the pickle alone) or the CPU (mapped or read)."""
    import torch

    try:
        return torch.load(path, map_location="meta" if meta else "cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        # torch names the class or function the file would call ("Unsupported global: ..."); anything
        # else it could not unpickle is simply not a torch file.
        if "global" not in str(exc).lower():
            raise UsageError(f"{path}: not a readable .pt file (torch.load could not read it)") from None
        raise UsageError(
            f"{path}: refused: it holds Python objects that would run code when unpickled (torch.load with "
            "weights_only=True rejected it); save plain tensors or a dict of them, or convert it to .safetensors"
        ) from None
