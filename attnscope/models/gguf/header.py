"""A GGUF file's header and tensor table, read with `struct` and checked against the file's size before anything
is allocated: the metadata (key -> value) and where each tensor's bytes lie, nothing of the tensor data.

The layout (llama.cpp's docs/gguf.md, read as the `gguf` package's `GGUFReader` reads it):

    magic "GGUF", version u32 (2 or 3), tensor_count u64, kv_count u64
    kv_count times:      key (u64 length + UTF-8), value type u32, value
    tensor_count times:  name, n_dims u32, dims u64 x n_dims (fastest first), ggml type u32, offset u64
    padding to `general.alignment` (32), then the tensor data, each tensor at its offset from there

`GGUFReader` itself turns every metadata value into NumPy arrays (two seconds for a 49k-token vocabulary) and
trusts the counts it reads (a count of 2**60 allocates, or loops for ever); this reader walks the same layout
in one pass, refusing in one line a count, length or tensor that reaches past the end of the file, and keeps
the work of a hostile header small (issue 43; benchmarks/bench_gguf_hostile.py):

- an array longer than `LAZY` entries, and a string longer than `LAZY_TEXT` bytes, is left in the file (`Array`,
  `Text`): an array of numbers is stepped over without a read, and its values are read only when a reader asks
  (`values()`: the config and the tokenizer read the few keys they use);
- arrays of strings and arrays of arrays must be walked entry by entry to find where they end: the whole header
  may walk at most `MAX_ENTRIES` such entries (a 262,144-token vocabulary with as many merges takes a quarter);
- counts beyond what a real file holds are refused before any loop: `MAX_KEYS` metadata entries,
  `MAX_TENSORS` tensors, keys of at most 65,535 bytes (gguf.md), tensor names shorter than 64 (llama.cpp's
  GGML_MAX_NAME);
- the pages a long walk has passed are handed back (madvise), so the resident set stays small.

tests/test_gguf.py holds it equal to `GGUFReader` on every field and tensor.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from attnscope.errors import UsageError

if TYPE_CHECKING:
    import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # GGUF v1 counted in 32 bits; llama.cpp and the gguf package read 2 and 3
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_DEPTH = 4  # arrays of arrays: no model writes deeper
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
MAX_KEYS = 1 << 16  # converters write a few dozen metadata entries
MAX_TENSORS = 1 << 17  # the largest models list a few thousand tensors
MAX_KEY = (1 << 16) - 1  # gguf.md: a key is at most 65,535 bytes
MAX_NAME = 64  # GGML_MAX_NAME: llama.cpp's gguf.cpp refuses a tensor name of 64 bytes or more
MAX_ENTRIES = 1 << 21  # strings and arrays inside arrays, the whole header: 8x a 262k-token vocabulary
MAX_TEXT = 1 << 16  # bytes of one string inside an array, read: no token or merge comes near
LAZY = 64  # arrays longer than this are left in the file (Array)
LAZY_TEXT = 1 << 16  # strings longer than this are left in the file (Text: a chat template, a licence)
RELEASE = 1 << 26  # a walk hands back the pages it has passed every 64 MiB

# value type -> (struct format, size): GGUFValueType's scalars
SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
           7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
STRING, ARRAY = 8, 9
_U64 = struct.Struct("<Q")
T = TypeVar("T")


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
class Array:
    """An array left in the file (a 49k-token vocabulary, its merges, its scores): its length is known, its
    entries are read when asked for (`values()`), so a run that reads no text never holds them. `item` is the
    entries' value type, `start` the first entry's byte."""

    path: Path
    key: str
    start: int
    count: int
    item: int

    def __len__(self) -> int:
        return self.count

    def values(self) -> list[Any]:
        """Every entry, read now (arrays inside it too); a count no real array has is refused first."""
        if self.count > MAX_ENTRIES:
            raise UsageError(f"{{model}} {self.path}: its metadata {self.key} holds {self.count:,} values; no model's "
                             f"metadata array holds more than {MAX_ENTRIES:,}, so the header is damaged", "model")
        with _mapped(self.path) as (blob, size):
            walk = _Walk(self.path, blob, size)
            walk.pos = self.start
            return walk._entries(self.item, self.count, self.key, 1)


Strings = Array  # the name the tokenizer's first reader used: an array left in the file


@dataclass(frozen=True)
class Text:
    """A string value left in the file (longer than LAZY_TEXT bytes: a chat template, a licence)."""

    path: Path
    key: str
    start: int
    length: int

    def __len__(self) -> int:
        return self.length

    def values(self) -> str:
        with _mapped(self.path) as (blob, size):
            walk = _Walk(self.path, blob, size)
            walk.pos = self.start
            return walk._decode(self.length, self.key)


LAZY_TYPES = (Array, Text)


@dataclass
class Header:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_start: int


class _mapped:
    """The file memory-mapped for reading: `(blob, size)`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> tuple[mmap.mmap, int]:
        try:
            self.handle = open(self.path, "rb")
            self.blob = mmap.mmap(self.handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            if hasattr(self, "handle"):
                self.handle.close()
            raise UsageError(f"{{model}} {self.path}: cannot be read ({getattr(exc, 'strerror', None) or exc}); "
                             "the file changed or was removed since it was opened", "model") from None
        return self.blob, len(self.blob)

    def __exit__(self, *_: object) -> None:
        self.blob.close()
        self.handle.close()


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
        self.entries = 0  # strings and arrays walked inside arrays so far (MAX_ENTRIES)
        self.released = 0  # the pages before this byte were handed back

    def header(self) -> Header:
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
        for count, most, what in ((kv_count, MAX_KEYS, "metadata entries"), (tensor_count, MAX_TENSORS, "tensors")):
            if count > most:
                raise self._bad(f"says it holds {count:,} {what}; no model has more than {most:,}, so the header is "
                                "damaged")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string("a metadata key", MAX_KEY)
            shown = key if len(key) <= 80 else f"{key[:80]}..."  # as messages name it
            kind = self._unpack("<I", 4, shown)
            metadata[key] = self._value(kind, shown)
        table = [self._tensor() for _ in range(tensor_count)]
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            shown = repr(alignment) if isinstance(alignment, (int, float, bool)) else "not a number"
            raise self._bad(f"general.alignment is {shown}; it must be a power of two")
        data_start = -(-self.pos // alignment) * alignment
        return Header(self.path, version, metadata, self._tensors(table, data_start, alignment), data_start)

    def _tensors(self, table: list[tuple[str, tuple[int, ...], int, int]], data_start: int,
                 alignment: int) -> dict[str, TensorInfo]:
        """The tensor table checked: a name once, a known type, each tensor's bytes inside the file. Where a
        tensor reaches past the end, the table says whether the file was cut short (the tensors lie one after
        the other, as every writer lays them, and the file ends early) or the header is damaged (an offset
        that no writer would give)."""
        from attnscope.models.gguf import quants

        tensors: dict[str, TensorInfo] = {}
        expected = 0  # where the next tensor starts when the tensors lie one after the other
        laid_out = True
        for name, shape, ggml_type, offset in table:
            if name in tensors:
                raise self._bad(f"lists tensor {name} twice")
            nbytes = quants.byte_count(self.path, name, ggml_type, shape)
            laid_out = laid_out and offset == expected
            expected = -(-(offset + nbytes) // alignment) * alignment
            tensors[name] = TensorInfo(name, shape, ggml_type, self.path, data_start + offset, nbytes)
        for info in tensors.values():
            if info.start + info.nbytes > self.size:
                where = (f"its {info.nbytes:,} bytes at offset {info.start:,}, the file {self.size:,}")
                if laid_out:
                    raise self._bad(f"ends inside tensor {info.name} ({where}); the file is truncated: download it "
                                    "again")
                raise self._bad(f"places tensor {info.name} past its end ({where}), where no writer would put it; "
                                "the header is damaged: download the file again")
        return tensors

    # --- pieces ---------------------------------------------------------------------------------------------

    def _tensor(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string("a tensor name", MAX_NAME - 1)
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

    def _value(self, kind: int, key: str) -> Any:
        """A metadata value: a number, a string, or an array (read where it is short, else left in the file)."""
        if kind == STRING:
            length = self._unpack("<Q", 8, key)
            self._fits(length, 1, f"bytes of {key}")
            if length <= LAZY_TEXT:
                return self._decode(length, key)
            text = Text(self.path, key, self.pos, length)
            self.pos += length
            return text
        if kind != ARRAY:
            return self._scalar(kind, key)
        item = self._unpack("<I", 4, key)
        count = self._unpack("<Q", 8, key)
        start = self.pos
        if count <= LAZY and item != ARRAY:  # arrays of arrays are left in the file: no model reads one
            if item == STRING:
                self._count(count, key)
            return self._entries(item, count, key, 1)
        self._skip(item, count, key, 1)
        return Array(self.path, key, start, count, item)

    def _scalar(self, kind: int, key: str) -> Any:
        if kind not in SCALARS:
            raise self._bad(f"{key} has value type {kind}, which GGUF does not define (0 to 12)")
        fmt, width = SCALARS[kind]
        return self._unpack(fmt, width, key)

    def _entries(self, item: int, count: int, key: str, depth: int) -> list[Any]:
        """`count` entries of type `item`, read (an array's values)."""
        if item in SCALARS:
            fmt, width = SCALARS[item]
            self._fits(count, width, f"values of {key}")
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.blob, self.pos))
            self.pos += count * width
            return values
        if item == STRING:
            self._fits(count, 8, f"values of {key}")
            return [self._string(f"string {i} of {key}", MAX_TEXT) for i in range(count)]
        if item == ARRAY:
            if depth >= MAX_DEPTH:
                raise self._bad(f"{key} nests arrays more than {MAX_DEPTH} deep")
            self._fits(count, 12, f"values of {key}")
            out = []
            for _ in range(count):
                inner, n = self._unpack("<I", 4, key), self._unpack("<Q", 8, key)
                out.append(self._entries(inner, n, key, depth + 1))
            return out
        raise self._bad(f"{key} is an array of value type {item}, which GGUF does not define (0 to 12)")

    def _skip(self, item: int, count: int, key: str, depth: int) -> None:
        """Step over `count` entries of type `item` without reading them: numbers at once, strings and arrays
        one entry at a time, each counted against MAX_ENTRIES."""
        if item in SCALARS:
            width = SCALARS[item][1]
            self._fits(count, width, f"values of {key}")
            self.pos += count * width
            return
        if item not in (STRING, ARRAY):
            raise self._bad(f"{key} is an array of value type {item}, which GGUF does not define (0 to 12)")
        if item == ARRAY and depth >= MAX_DEPTH:
            raise self._bad(f"{key} nests arrays more than {MAX_DEPTH} deep")
        self._fits(count, 8 if item == STRING else 12, f"values of {key}")
        self._count(count, key)
        if item == ARRAY:
            for _ in range(count):
                inner, n = self._unpack("<I", 4, key), self._unpack("<Q", 8, key)
                self._skip(inner, n, key, depth + 1)
            return
        blob, pos, size, unpack = self.blob, self.pos, self.size, _U64.unpack_from
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self._ended(f"string {i} of {key}")
            pos += 8 + unpack(blob, pos)[0]
            if pos > size:
                raise self._bad(f"says string {i} of {key} runs to byte {pos:,}, past its {size:,} bytes; the "
                                "header is damaged")
            if pos - self.released > RELEASE:
                self._release(pos)
        self.pos = pos

    def _count(self, count: int, key: str) -> None:
        """`count` more strings or arrays walked one at a time: past MAX_ENTRIES in the header, refused."""
        self.entries += count
        if self.entries > MAX_ENTRIES:
            raise self._bad(f"holds more than {MAX_ENTRIES:,} strings and arrays inside its metadata arrays ({key} "
                            f"alone {count:,}); no model's header does, so the header is damaged")

    def _release(self, upto: int) -> None:
        """Hand back the mapped pages before `upto`: a long walk keeps no more of the file resident than this."""
        end = upto - upto % mmap.PAGESIZE
        if end > self.released and hasattr(self.blob, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self.blob.madvise(mmap.MADV_DONTNEED, self.released, end - self.released)
        self.released = end

    def _string(self, what: str, most: int) -> str:
        length = self._unpack("<Q", 8, what)
        self._fits(length, 1, f"bytes of {what}")
        if length > most:
            raise self._bad(f"says {what} is {length:,} bytes long; it can be at most {most:,}, so the header is "
                            "damaged")
        return self._decode(length, what)

    def _decode(self, length: int, what: str) -> str:
        raw = self.blob[self.pos : self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self._bad(f"{what} is not UTF-8 text; the header is damaged") from None

    def _unpack(self, fmt: str, width: int, what: str) -> Any:
        if self.pos + width > self.size:
            raise self._ended(what)
        value = struct.unpack_from(fmt, self.blob, self.pos)[0]
        self.pos += width
        return value

    def _ended(self, what: str) -> UsageError:
        return self._bad(f"ends inside its header (reading {what} at byte {self.pos:,} of {self.size:,}): the file "
                         "is truncated, or a length in its header is damaged; download it again")

    def _fits(self, count: int, least: int, what: str) -> None:
        """`count` items of at least `least` bytes each must fit in what is left of the file."""
        if count * least > self.size - self.pos:
            raise self._bad(f"says {count:,} {what} at byte {self.pos:,}, more than its {self.size:,} bytes can "
                            "hold; the header is damaged")

    def _bad(self, what: str) -> UsageError:
        return UsageError(f"{{model}} {self.path} {what}", "model")


def read_bytes(info: TensorInfo, lo: int, hi: int) -> np.ndarray:
    """Bytes lo:hi of a tensor, copied out of a memory map of just those pages (released on return)."""
    return with_bytes(info, lo, hi, lambda view: view.copy())


def with_bytes(info: TensorInfo, lo: int, hi: int, use: Callable[[np.ndarray], T]) -> T:
    """`use(view)`, `view` bytes lo:hi of a tensor (uint8) in a private memory map of just those pages, unmapped
    on return: read in place (a weight expanded at each use skips `read_bytes`' copy). What `use` returns must
    not hold the view."""
    import numpy as np

    start, end = info.start + lo, info.start + hi
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    try:
        with open(info.path, "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), end - aligned, offset=aligned, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{{model}} {info.path}: tensor {info.name} cannot be read ({exc}); the file is truncated "
                         "or changed since it was opened", "model") from None
    view = np.frombuffer(mapped, dtype=np.uint8, count=end - start, offset=start - aligned)
    try:
        return use(view)
    finally:
        del view
        try:
            mapped.close()
        except BufferError:  # an exception's traceback still holds the view: unmapped once it is let go
            pass
