"""Reading and writing tensor files (.npy .npz .safetensors .pt/.pth), with errors a user can act on.

Saving never leaves a half-written file and never overwrites one unless asked: it writes to a
temporary file beside the target and renames it into place.
"""

from __future__ import annotations

import json
import os
import pickle
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnscope.errors import ResourceError, UsageError

if TYPE_CHECKING:
    import torch

LOAD_FORMATS = (".npy", ".npz", ".safetensors", ".pt", ".pth")
SAVE_FORMATS = (".safetensors", ".npz", ".pt", ".pth")


def split_spec(spec: str) -> tuple[Path, str | None]:
    """`file.npz:name` -> (file.npz, name). A path that exists as given is taken whole, colons and all."""
    path = Path(spec)
    if path.exists() or ":" not in spec:
        return path, None
    file, _, name = spec.rpartition(":")
    return Path(file), (name or None)


def load_tensor(spec: str) -> torch.Tensor:
    """Load one tensor from `FILE` or `FILE:NAME` (the name picks one tensor out of .npz/.safetensors/.pt)."""
    path, name = split_spec(spec)
    suffix = path.suffix.lower()
    if suffix not in LOAD_FORMATS:
        raise UsageError(f"{spec}: unknown tensor file type {suffix or '(no extension)'!r}; "
                         f"use one of {', '.join(LOAD_FORMATS)}")
    if not path.is_file():
        raise UsageError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    if not os.access(path, os.R_OK):
        raise UsageError(f"{path}: cannot read the file (permission denied)")
    _check_fits(path)
    try:
        if suffix == ".npy":
            return _one(spec, {"": _load_npy(path)}, name, single=True)
        if suffix == ".npz":
            return _one(spec, _load_npz(path), name)
        if suffix == ".safetensors":
            return _one(spec, _load_safetensors(path), name)
        return _one(spec, _load_torch(path), name)
    except UsageError:
        raise
    except (ValueError, OSError, RuntimeError, EOFError, KeyError) as exc:
        raise UsageError(f"{path}: not a readable {suffix} tensor file ({_first_line(exc)})") from exc


def _check_fits(path: Path) -> None:
    """A file larger than the memory left would get the process killed halfway through loading it."""
    from attnscope.cost import available_memory, format_bytes

    size, available = path.stat().st_size, available_memory()
    if available is not None and size > available:
        raise ResourceError(f"{path} is {format_bytes(size)}, more than the {format_bytes(available)} of memory "
                            "this machine has available; use a smaller slice of it")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def _one(spec: str, tensors: Mapping[str, Any], name: str | None, single: bool = False) -> torch.Tensor:
    import torch

    if single and name:
        raise UsageError(f"{spec}: a .npy file holds one array; drop ':{name}'")
    if name is None:
        if len(tensors) != 1:
            listed = ", ".join(sorted(tensors)[:10]) or "nothing"
            raise UsageError(f"{spec} holds {len(tensors)} tensors ({listed}); choose one with FILE:NAME")
        name = next(iter(tensors))
    if name not in tensors:
        raise UsageError(f"{spec}: no tensor named {name!r}; it holds {', '.join(sorted(tensors)[:10])}")
    value = tensors[name]
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.from_numpy(value)
        except TypeError as exc:
            raise UsageError(f"{spec}: array of dtype {value.dtype} cannot be a tensor ({exc})") from None
    return value


# What each format's first bytes are; a file without them is not that format, whatever its name says.
MAGIC = {".npy": b"\x93NUMPY", ".npz": b"PK"}


def _check_magic(path: Path) -> None:
    magic = MAGIC[path.suffix.lower()]
    with open(path, "rb") as handle:
        if handle.read(len(magic)) != magic:
            raise UsageError(f"{path}: not a {path.suffix.lower()} file (it does not start with the format's header)")


def _load_npy(path: Path) -> Any:
    import numpy as np

    _check_magic(path)
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as exc:
        if "allow_pickle" in str(exc) or "Object arrays" in str(exc):
            raise UsageError(f"{path}: holds Python objects, which would run code when unpickled; refused") from None
        raise


def _load_npz(path: Path) -> dict[str, Any]:
    import numpy as np

    _check_magic(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {key: archive[key] for key in archive.files}
    except ValueError as exc:
        if "allow_pickle" in str(exc) or "Object arrays" in str(exc):
            raise UsageError(f"{path}: holds Python objects, which would run code when unpickled; refused") from None
        raise


def _load_safetensors(path: Path) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except SafetensorError as exc:
        raise UsageError(f"{path}: not a valid .safetensors file ({_first_line(exc)})") from None


def _load_torch(path: Path) -> dict[str, Any]:
    import torch

    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch names the class or function the file would call ("Unsupported global: ..."); anything
        # else it could not unpickle is simply not a torch file.
        if "global" not in str(exc).lower():
            raise UsageError(f"{path}: not a readable .pt file (torch.load could not read it)") from None
        raise UsageError(
            f"{path}: refused: it holds Python objects that would run code when unpickled (torch.load with "
            "weights_only=True rejected it); save plain tensors or a dict of them, or convert it to .safetensors"
        ) from None
    if isinstance(loaded, torch.Tensor):
        return {"": loaded}
    if isinstance(loaded, Mapping):
        tensors = {str(k): v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
        if tensors:
            return tensors
    raise UsageError(f"{path}: holds a {type(loaded).__name__}, not a tensor or a dict of tensors")


def check_writable(path: str | os.PathLike[str], force: bool = False) -> Path:
    """Refuse, before any work, a target that is of an unknown type, exists (without force) or has no folder."""
    target = Path(path)
    if target.suffix.lower() not in SAVE_FORMATS:
        raise UsageError(f"--save {target}: unknown file type; end the name with one of {', '.join(SAVE_FORMATS)}")
    if target.is_dir():
        raise UsageError(f"--save {target}: is a folder; give a file name")
    if target.exists() and not force:
        raise UsageError(f"--save {target}: the file exists; pass --force to replace it")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"--save {target}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"--save {target}: cannot write in {parent} (permission denied)")
    return target


def save_tensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str], *, force: bool = False,
                 metadata: Mapping[str, Any] | None = None) -> Path:
    """Write tensors by name to .safetensors, .npz or .pt (by the extension), atomically.

    `metadata` (e.g. each step's dims and op) goes into the safetensors header and into .pt files;
    .npz has no place for it.
    """
    target = check_writable(path, force)
    suffix = target.suffix.lower()
    if any(t.device.type == "meta" for t in tensors.values()):
        raise UsageError("--save needs real numbers, and --meta computes none; drop one of the two")
    # Contiguous private copies: safetensors refuses views that share memory (Q_split is a view of Q_feat).
    plain = {name: t.detach().cpu().contiguous().clone() for name, t in tensors.items()}
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    os.close(fd)  # each format's writer opens the path itself
    try:
        _write(tmp, suffix, plain, metadata or {})
        os.chmod(tmp, _file_mode(target))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _file_mode(target: Path) -> int:
    """mkstemp makes its file private (0600); the saved file gets what a plain open() would give it, or
    keeps the mode of the file it replaces."""
    if target.exists():
        return target.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _write(path: str, suffix: str, tensors: dict[str, torch.Tensor], metadata: Mapping[str, Any]) -> None:
    """Every writer streams the tensors' own memory to the file: no second copy of the run in memory
    (safetensors' `save` would build the whole file as bytes, twice over, before writing it)."""
    import torch

    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(tensors, path, metadata={"attnscope": json.dumps(metadata)})
    elif suffix == ".npz":
        import numpy as np

        if any(t.dtype == torch.bfloat16 for t in tensors.values()):
            raise UsageError("--save: .npz cannot hold bfloat16; save to .safetensors or .pt instead")
        with open(path, "wb") as handle:  # a path would get ".npz" appended to the temporary name
            np.savez(handle, **{name: t.numpy() for name, t in tensors.items()})  # type: ignore[arg-type]
    else:
        torch.save({**tensors, "__attnscope__": dict(metadata)} if metadata else tensors, path)


STATS_CHUNK = 1 << 20  # elements: float64 copies of this size at most, whatever the tensor's size


def _chunks(tensor: torch.Tensor, limit: int = STATS_CHUNK) -> Iterator[torch.Tensor]:
    """Flat pieces of at most `limit` elements; only a piece is ever copied (a permuted view stays a view)."""
    if tensor.numel() <= limit:
        yield tensor.reshape(-1)
    elif tensor.dim() == 1:
        yield from tensor.split(limit)
    else:
        rows = max(1, limit // tensor[0].numel())  # whole rows per piece
        for block in tensor.split(rows, dim=0):
            if block.numel() <= limit:
                yield block.reshape(-1)
            else:  # one row is larger than a piece
                yield from _chunks(block[0], limit)


def tensor_stats(tensor: torch.Tensor) -> dict[str, float | int] | None:
    """min, max, mean, std (unbiased) over the finite values, and how many are NaN or Inf; None for a meta
    tensor. Computed chunk by chunk in float64 (Chan's merge of means and squared deviations), so a
    statistic never needs more than a small fraction of the tensor's memory."""
    import torch

    if tensor.device.type == "meta" or tensor.numel() == 0:
        return None
    count, mean, m2 = 0, 0.0, 0.0
    low, high = float("inf"), float("-inf")
    nan = inf = 0
    for chunk in _chunks(tensor.detach()):
        values = chunk.to(torch.float64)
        finite_mask = torch.isfinite(values)
        nan += int(torch.isnan(values).sum())
        inf += int(torch.isinf(values).sum())
        finite = values[finite_mask]
        n = finite.numel()
        if not n:
            continue
        chunk_mean = float(finite.mean())
        chunk_m2 = float(((finite - chunk_mean) ** 2).sum())
        delta, total = chunk_mean - mean, count + n
        mean += delta * n / total
        m2 += chunk_m2 + delta * delta * count * n / total
        count = total
        low, high = min(low, float(finite.min())), max(high, float(finite.max()))
    stats: dict[str, float | int] = {"nan": nan, "inf": inf}
    if count:
        stats.update(min=low, max=high, mean=mean, std=(m2 / (count - 1)) ** 0.5 if count > 1 else 0.0)
    else:
        stats.update(min=float("nan"), max=float("nan"), mean=float("nan"), std=float("nan"))
    return stats


def preview(tensor: torch.Tensor, limit: int) -> str:
    """The numbers of a small tensor, or the corners of a large one, four significant digits."""
    import torch

    if tensor.device.type == "meta":
        return "(meta tensor: shape only, no values)"
    torch.set_printoptions(precision=4, threshold=limit, edgeitems=3, linewidth=96, sci_mode=False)
    try:
        return str(tensor.detach())
    finally:
        torch.set_printoptions(profile="default")
