"""A GGUF file's header and tensor table, read with `struct` and checked against the file's size before anything
is allocated: the metadata (key -> value) and where each tensor's bytes lie, nothing of the tensor data.

The layout (llama.cpp's docs/gguf.md, read as the `gguf` package's `GGUFReader` reads it):

    magic "GGUF", version u32 (2 or 3), tensor_count u64, kv_count u64
    kv_count times:      key (u64 length + UTF-8), value type u32, value
    tensor_count times:  name, n_dims u32, dims u64 x n_dims (fastest first), ggml type u32, offset u64
    padding to `general.alignment` (32), then the tensor data, each tensor at its offset from there

`GGUFReader` itself turns every metadata value into NumPy arrays (two seconds for a 49k-token vocabulary) and
trusts the counts it reads (a count of 2**60 allocates, or loops for ever); this reader walks the same layout
in one pass, refusing in one line a count, length or tensor that reaches past the end of the file.
tests/test_gguf_header.py holds it equal to `GGUFReader` on every field and tensor.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError

if TYPE_CHECKING:
    import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # GGUF v1 counted in 32 bits; llama.cpp and the gguf package read 2 and 3
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_DEPTH = 4  # arrays of arrays: no model writes deeper
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT

# value type -> (struct format, size): GGUFValueType's scalars
SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
           7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the table: its name, its shape in torch order (`[rows, cols]`: GGUF lists the fastest
    dimension first), its ggml type, and its bytes in `path` (absolute offsets)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    path: Path
    start: int
    nbytes: int


@dataclass(frozen=True)
class Strings:
    """An array of strings left in the file (a 49k-token vocabulary, its merges): its length is known, its
    strings are read when asked for (`values`), so a run that reads no text never holds them."""

    path: Path
    start: int
    count: int

    def __len__(self) -> int:
        return self.count

    def values(self) -> list[str]:
        with open(self.path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            walk = _Walk(self.path, blob, len(blob))
            walk.pos = self.start
            return [walk._string(f"string {i} of an array") for i in range(self.count)]


LAZY = 64  # string arrays longer than this are left in the file (Strings)


@dataclass
class Header:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_start: int


def read_header(path: Path) -> Header:
    """The metadata and tensor table of `path`, every count, length and tensor checked against its size."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, 2)
            if size < 24:
                raise UsageError(f"{{model}} {path}: {size} bytes, too short to be a GGUF file (its header alone is "
                                 "24 bytes); the file is truncated or not a GGUF", "model")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as blob:
                return _Walk(path, blob, size).header()
    except OSError as exc:
        raise UsageError(f"{{model}} {path}: cannot be read ({exc.strerror or type(exc).__name__})", "model") from None


class _Walk:
    """One pass over the header, each read bounded by the file's size."""

    def __init__(self, path: Path, blob: mmap.mmap, size: int) -> None:
        self.path, self.blob, self.size, self.pos = path, blob, size, 0

    def header(self) -> Header:
        from attnscope.models.gguf import quants

        magic = bytes(self.blob[:4])
        if magic != MAGIC:
            raise self._bad(f"starts with {magic!r}, not the GGUF magic b'GGUF'; not a GGUF file")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", self.blob, 4)
        if version & 0xFFFF == 0 and version:
            raise self._bad(f"is a big-endian GGUF (version {version:#x}); attnscope reads little-endian files")
        if version not in VERSIONS:
            raise self._bad(f"is GGUF version {version}; attnscope reads versions {' and '.join(map(str, VERSIONS))} "
                            "(convert it again with a current llama.cpp)")
        self.pos = 24
        # the least each entry takes: a key of 0 bytes + type + a 1-byte value; a tensor with 0 dims
        self._fits(kv_count, 8 + 4 + 1, "metadata entries")
        self._fits(tensor_count, 8 + 4 + 4 + 8, "tensors")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string("a metadata key")
            kind = self._unpack("<I", 4, key)
            metadata[key] = self._value(kind, key, 0)
        table = [self._tensor() for _ in range(tensor_count)]
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise self._bad(f"general.alignment is {alignment!r}; it must be a power of two")
        data_start = -(-self.pos // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, offset in table:
            if name in tensors:
                raise self._bad(f"lists tensor {name} twice")
            nbytes = quants.byte_count(self.path, name, ggml_type, shape)
            start = data_start + offset
            if start + nbytes > self.size:
                raise self._bad(f"ends inside tensor {name} (its {nbytes:,} bytes at offset {start:,}, the file "
                                f"{self.size:,}); the file is truncated: download it again")
            tensors[name] = TensorInfo(name, shape, ggml_type, self.path, start, nbytes)
        return Header(self.path, version, metadata, tensors, data_start)

    # --- pieces ---------------------------------------------------------------------------------------------

    def _tensor(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string("a tensor name")
        n_dims = self._unpack("<I", 4, name)
        if not 1 <= n_dims <= MAX_DIMS:
            raise self._bad(f"tensor {name} has {n_dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}")
        dims = [self._unpack("<Q", 8, name) for _ in range(n_dims)]
        ggml_type = self._unpack("<I", 4, name)
        offset = self._unpack("<Q", 8, name)
        if any(d >= 1 << 40 for d in dims):
            raise self._bad(f"tensor {name} has a dimension of {max(dims):,}; no tensor is that large")
        if 0 in dims:
            raise self._bad(f"tensor {name} has a dimension of 0 ({dims}); the header is damaged")
        return name, tuple(reversed(dims)), ggml_type, offset

    def _value(self, kind: int, key: str, depth: int) -> Any:
        if kind in SCALARS:
            fmt, width = SCALARS[kind]
            return self._unpack(fmt, width, key)
        if kind == STRING:
            return self._string(key)
        if kind == ARRAY:
            if depth >= MAX_DEPTH:
                raise self._bad(f"{key} nests arrays more than {MAX_DEPTH} deep")
            item = self._unpack("<I", 4, key)
            count = self._unpack("<Q", 8, key)
            if item in SCALARS:
                fmt, width = SCALARS[item]
                self._fits(count, width, f"values of {key}")
                values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.blob, self.pos))
                self.pos += count * width
                return values
            self._fits(count, 8 if item == STRING else 12, f"values of {key}")
            if item == STRING and count > LAZY:  # walked (each length checked), not decoded
                start = self.pos
                for _ in range(count):
                    length = self._unpack("<Q", 8, key)
                    self._fits(length, 1, f"bytes of {key}")
                    self.pos += length
                return Strings(self.path, start, count)
            return [self._value(item, key, depth + 1) for _ in range(count)]
        raise self._bad(f"{key} has value type {kind}, which GGUF does not define (0 to 12)")

    def _string(self, what: str) -> str:
        length = self._unpack("<Q", 8, what)
        self._fits(length, 1, f"bytes of {what}")
        raw = self.blob[self.pos : self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self._bad(f"{what} is not UTF-8 text ({raw[:40]!r}); the header is damaged") from None

    def _unpack(self, fmt: str, width: int, what: str) -> Any:
        if self.pos + width > self.size:
            raise self._bad(f"ends inside its header (reading {what} at byte {self.pos:,}); the file is truncated")
        value = struct.unpack_from(fmt, self.blob, self.pos)[0]
        self.pos += width
        return value

    def _fits(self, count: int, least: int, what: str) -> None:
        """`count` items of at least `least` bytes each must fit in what is left of the file."""
        if count * least > self.size - self.pos:
            raise self._bad(f"says {count:,} {what} at byte {self.pos:,}, more than its {self.size:,} bytes can "
                            "hold; the header is damaged")

    def _bad(self, what: str) -> UsageError:
        return UsageError(f"{{model}} {self.path} {what}", "model")


def read_bytes(info: TensorInfo, lo: int, hi: int) -> np.ndarray:
    """Bytes lo:hi of a tensor, copied out of a memory map of just those pages (released on return)."""
    import numpy as np

    start, end = info.start + lo, info.start + hi
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    try:
        with open(info.path, "rb") as handle, \
                mmap.mmap(handle.fileno(), end - aligned, offset=aligned, access=mmap.ACCESS_READ) as mapped:
            view = np.frombuffer(mapped, dtype=np.uint8, count=end - start, offset=start - aligned)
            out = view.copy()
            del view
            return out
    except (OSError, ValueError) as exc:
        raise UsageError(f"{{model}} {info.path}: tensor {info.name} cannot be read ({exc}); the file is truncated "
                         "or changed since it was opened", "model") from None

