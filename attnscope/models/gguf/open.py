"""Finding a GGUF model and opening it as its family page reads it.

`--model` names a GGUF as a file (`model.Q4_K_M.gguf`; any file that starts with the GGUF magic, as Ollama's
blobs do), a folder holding one (and no config.json), the first or any shard of a split model
(`name-00001-of-00003.gguf`, as llama.cpp's gguf-split writes it: every shard a GGUF of its own, the metadata
in the first), or `ollama:NAME[:TAG]`: the model blob Ollama's manifest names, in `$OLLAMA_MODELS` or
`~/.ollama/models`, read where it lies (no copy, no network).
"""

from __future__ import annotations

import glob
import json
import os
import re
import stat
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.models.gguf.header import MAGIC, Header, read_header

if TYPE_CHECKING:
    from attnscope.models.gguf.checkpoint import GgufCheckpoint

SHARD = re.compile(r"(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
OLLAMA_MODEL = "application/vnd.ollama.image.model"
OLLAMA_HOST = "registry.ollama.ai"
NOTE = ("GGUF: the attention shown is that of the dequantized weights, computed in float32; llama.cpp's own "
        "kernels also quantize the activations, so its numbers differ slightly")


def locate(model: str) -> Path | None:
    """The GGUF file (a split model's first shard) `model` names, or None where it names no GGUF."""
    if model.startswith("ollama:"):
        return ollama_blob(model.removeprefix("ollama:"))
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        found = sorted(p for p in path.iterdir() if p.suffix == ".gguf" and p.is_file())
        firsts = [p for p in found if (shard := SHARD.fullmatch(p.name)) is None or shard["no"] == "00001"]
        if len(firsts) > 1:
            raise UsageError(f"{{model}} {path} holds {len(firsts)} GGUF files ({', '.join(p.name for p in firsts[:4])}"
                             f"{', ...' if len(firsts) > 4 else ''}); give the one to read", "model")
        if not firsts and found:  # shards only, and not the first
            return _first_shard(found[0])
        return firsts[0] if firsts else None
    if path.suffix == ".gguf" and path.exists() and not path.is_file():
        raise UsageError(f"{{model}} {model}: {not_regular(path)}; give a GGUF file", "model")
    if path.is_file() and (path.suffix == ".gguf" or _starts_with_magic(path)):
        return _first_shard(path)
    if path.suffix == ".gguf":
        raise UsageError(f"{{model}} {model}: no such file", "model")
    return None


def _first_shard(path: Path) -> Path:
    """A split model's first shard, which holds the metadata, from any of its shards (a file that is no shard is
    itself); refused where the first shard is not beside the one named."""
    shard = SHARD.fullmatch(path.name)
    if shard is None:
        return path
    first = path.with_name(f"{shard['stem']}-00001-of-{shard['count']}.gguf")
    if not first.is_file():
        raise UsageError(f"{{model}} {path} is shard {int(shard['no'])} of {int(shard['count'])} of a split GGUF, and "
                         f"shard 1 ({first.name}), which holds the model's metadata, is not beside it; download every "
                         "shard", "model")
    return first


def not_regular(path: Path) -> str:
    """What a path that is there but is no regular file is, in words (`is a folder, not a file`)."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        return f"cannot be read ({exc.strerror or type(exc).__name__})"
    if stat.S_ISDIR(mode):
        return "is a folder, not a file"
    kind = "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else \
        "a pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
    return f"is {kind}, not a regular file"


def is_gguf_file(path: Path) -> bool:
    """Whether a located model is a GGUF file: a .gguf (whose header then says what is wrong with it), or a file
    that starts with the magic (an Ollama blob); a model folder is a folder, and config.json is neither."""
    return path.is_file() and (path.suffix == ".gguf" or _starts_with_magic(path))


def _starts_with_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == MAGIC
    except OSError:
        return False


MAX_MANIFEST = 1 << 20  # Ollama's manifests are a few hundred bytes
MAX_PART = 255  # NAME_MAX: no name part or tag longer can be a file in the store


def ollama_blob(name: str) -> Path:
    """Ollama's model blob for NAME[:TAG] (tag `latest` by default): its manifest's model layer. The manifest and
    the blob are read only where they lie inside the store, every link resolved (a link that leads out of it is
    refused), and the blob only where it is a GGUF file."""
    given = Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()
    base, _, tag = name.rpartition(":") if ":" in name and "/" not in name.rpartition(":")[2] else (name, "", "")
    parts = [p for p in base.split("/") if p]
    usage = (f"{{model}} ollama:{name}: give an Ollama model as ollama:NAME or ollama:NAME:TAG (ollama:llama3.2:1b)")
    if not parts or any(p in (".", "..") for p in parts) or "/" in tag or tag in (".", ".."):
        raise UsageError(usage, "model")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise UsageError(f"{usage}; a name holds no control characters", "model")
    if any(len(p.encode("utf-8", "surrogateescape")) > MAX_PART for p in (*parts, tag)):
        raise UsageError(f"{usage}; each part of the name, and the tag, is at most {MAX_PART} bytes", "model")
    try:
        root = Path(os.path.realpath(given))
    except (OSError, ValueError):
        root = given
    host = [OLLAMA_HOST, "library"] if len(parts) == 1 else [OLLAMA_HOST] if len(parts) == 2 else []
    manifest = _in_store(root, root.joinpath("manifests", *host, *parts, tag or "latest"), name, "manifest")
    if manifest is None or not manifest.is_file():
        where = root.joinpath("manifests", *host, *parts, tag or "latest")
        found = "" if manifest is None else f" ({not_regular(manifest)})"
        raise UsageError(f"{{model}} ollama:{name}: no manifest at {where}{found}; pull it with `ollama pull {name}`, "
                         "or point OLLAMA_MODELS at the folder that holds Ollama's manifests and blobs", "model")
    not_manifest = UsageError(f"{{model}} ollama:{name}: {manifest} is not an Ollama manifest with a model layer; "
                              f"pull it again with `ollama pull {name}`", "model")
    try:
        with open(manifest, "rb") as handle:
            raw = handle.read(MAX_MANIFEST + 1)
        if len(raw) > MAX_MANIFEST:
            raise not_manifest
        layers = json.loads(raw.decode("utf-8"))["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL)
    except (OSError, ValueError, KeyError, TypeError, StopIteration, AttributeError, RecursionError):
        raise not_manifest from None
    if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        shown = repr(digest) if len(repr(digest)) <= 80 else f"{repr(digest)[:80]}..."
        raise UsageError(f"{{model}} ollama:{name}: {manifest} names the model blob {shown}, not a sha256 digest",
                         "model")
    named = root / "blobs" / digest.replace(":", "-")
    blob = _in_store(root, named, name, "model blob")
    if blob is None:
        raise UsageError(f"{{model}} ollama:{name}: its model blob {named} is missing; pull it again with "
                         f"`ollama pull {name}`", "model")
    if not blob.is_file():
        raise UsageError(f"{{model}} ollama:{name}: its model blob {named} {not_regular(blob)}; the store is "
                         f"damaged: remove it and pull the model again with `ollama pull {name}`", "model")
    if not _starts_with_magic(blob):
        raise UsageError(f"{{model}} ollama:{name}: its model blob {named} is not a GGUF file (it does not start "
                         "with the GGUF magic); attnscope reads Ollama models stored as GGUF: pull it again with "
                         f"`ollama pull {name}`", "model")
    return blob


def _in_store(root: Path, path: Path, name: str, what: str) -> Path | None:
    """`path` with every link resolved, or None where nothing is there; refused where it leads outside `root`
    (the store, itself resolved), as a link in the store to another file, a device or a folder elsewhere would."""
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(root):
        raise UsageError(f"{{model}} ollama:{name}: its {what} {path} is a link that leads outside the Ollama store "
                         f"{root} (to {real}); attnscope reads only the store's own files: pull the model again with "
                         f"`ollama pull {name}`", "model")
    try:
        real.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UsageError(f"{{model}} ollama:{name}: its {what} {path} cannot be read ({exc.strerror or exc})",
                         "model") from None
    return real


def header_of(path: Path) -> Header:
    """The header of a GGUF, with every shard's tensors where it is split; read once per file and change."""
    shard = SHARD.fullmatch(path.name)
    parts = sorted(path.parent.glob(f"{glob.escape(shard['stem'])}-*-of-{shard['count']}.gguf")) if shard else [path]
    return _header(path, tuple((part, part.stat().st_mtime_ns, part.stat().st_size) for part in parts))


@lru_cache(maxsize=4)
def _header(path: Path, _stats: tuple[tuple[Path, int, int], ...]) -> Header:
    header = read_header(path)
    shard = SHARD.fullmatch(path.name)
    if shard is None:
        return header
    count = int(shard["count"])
    for number in range(2, count + 1):
        part = path.with_name(f"{shard['stem']}-{number:05d}-of-{shard['count']}.gguf")
        if not part.is_file():
            raise UsageError(f"{{model}} {path} is shard 1 of {count}, and shard {number} ({part.name}) is not beside "
                             "it; download every shard", "model")
        for name, info in read_header(part).tensors.items():
            if name in header.tensors:
                raise UsageError(f"{{model}} {part} holds tensor {name} again; the shards do not belong together",
                                 "model")
            header.tensors[name] = replace(info)
    return header


def read_gguf_config(path: Path) -> dict[str, Any]:
    """The config.json a family page reads, from the metadata (models/config.py makes it a Config)."""
    from attnscope.models.gguf.config import config_of

    return config_of(header_of(path))


def open_checkpoint(path: Path) -> GgufCheckpoint:
    from attnscope.models.gguf.checkpoint import GgufCheckpoint

    return GgufCheckpoint(header_of(path))
