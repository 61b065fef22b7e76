"""Where a model's files are, decided once: a folder saved by `save_pretrained`, or one GGUF file.

`hub.locate` has already turned `ollama:NAME`, a folder holding one `.gguf` and a shard into the file; what is left
to decide is the kind, and `source_of(path)` decides it once a path (and again only if the file changes). Every
reader then asks the `Source`: its settings (`config.json`, or the GGUF's metadata under config.json's names), its
checkpoint, its tokenizer, what a message calls its settings and how to fix them. No reader looks at the path's
suffix or magic again (config.py, checkpoint.py, tokenizer.py, shapes.py, runs/head.py, anatomy/, render/model.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnscope.models.gguf.checkpoint import GgufCheckpoint

FOLDER_FIX = "fix config.json or save the model again with save_pretrained"
GGUF_FIX = ("the GGUF file's metadata is damaged or not what llama.cpp writes: download it again, or convert the "
            "model again with llama.cpp's convert_hf_to_gguf.py")


@dataclass(frozen=True)
class Source:
    """A located model: `path` (the folder, or the GGUF file) and whether it is a GGUF file."""

    path: Path
    gguf: bool

    @property
    def settings_name(self) -> str:
        """What a message calls the model's settings."""
        return "its metadata" if self.gguf else "config.json"

    @property
    def fix_advice(self) -> str:
        """What to do about a bad setting: a folder's config.json is fixed or saved again; a GGUF file's settings
        are its metadata (models/gguf/config.py reads them under config.json's names), so the file is the thing
        to fix."""
        return GGUF_FIX if self.gguf else FOLDER_FIX

    def gguf_settings(self) -> dict[str, Any]:
        """A GGUF file's config.json, from its metadata (models/gguf/config.py)."""
        from attnscope.models.gguf.open import read_gguf_config

        return read_gguf_config(self.path)

    def gguf_checkpoint(self) -> GgufCheckpoint:
        """A GGUF file's tensors in transformers' names, dequantized when read."""
        from attnscope.models.gguf.open import open_checkpoint

        return open_checkpoint(self.path)

    def gguf_tokenizer(self) -> Any:
        """The tokenizer a GGUF file's metadata describes (a `tokenizers.Tokenizer`)."""
        from attnscope.models.gguf import tokenizer as gguf_tokenizer

        return gguf_tokenizer.load(self.path)


def source_of(path: Path) -> Source:
    """The source at `path`, decided once for the file as it is now (a changed file is decided again)."""
    try:
        seen = os.stat(path)
        stamp = (seen.st_ino, seen.st_mtime_ns, seen.st_size)
    except OSError:
        stamp = None
    return _decide(path, stamp)


@lru_cache(maxsize=64)
def _decide(path: Path, _stamp: tuple[int, int, int] | None) -> Source:
    from attnscope.models.gguf.open import is_gguf_file

    return Source(path, is_gguf_file(path))
