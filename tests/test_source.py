"""A model's source is decided once (models/source.py): a folder saved by save_pretrained or one GGUF file, the
kind read from the file itself (a .gguf, or any file that starts with GGUF's magic, as Ollama's blobs do), asked
of the Source by every reader and never of the path again."""

from __future__ import annotations

import ast
from pathlib import Path

import tiny_gguf

from attnscope.models.source import FOLDER_FIX, GGUF_FIX, source_of

PACKAGE = Path(__file__).resolve().parents[1] / "attnscope"


def test_a_folder_and_a_gguf_file_and_a_blob(tmp_path: Path) -> None:
    gguf = tiny_gguf.write("llama", tmp_path)
    blob = tmp_path / "sha256-0123"  # Ollama's blob: no suffix, GGUF's magic
    blob.write_bytes(gguf.read_bytes())
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    for path, is_gguf in ((gguf, True), (blob, True), (folder, False), (folder / "config.json", False)):
        source = source_of(path)
        assert source.gguf is is_gguf and source.path == path
        assert source.settings_name == ("its metadata" if is_gguf else "config.json")
        assert source.fix_advice == (GGUF_FIX if is_gguf else FOLDER_FIX)
    assert source_of(gguf).gguf_settings()["model_type"] == "llama"


def test_decided_once_and_again_when_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"not a model")
    first = source_of(path)
    assert not first.gguf and source_of(path) is first  # the same answer, not asked again
    path.write_bytes(b"GGUF" + bytes(60))  # now a blob with the magic: decided again
    assert source_of(path).gguf


def test_no_reader_asks_the_path_again() -> None:
    """Only models/source.py and the GGUF reader itself call is_gguf_file."""
    callers = []
    for file in PACKAGE.rglob("*.py"):
        relative = file.relative_to(PACKAGE).as_posix()
        if relative == "models/source.py" or relative.startswith("models/gguf/"):
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Name | ast.alias) and "is_gguf_file" in (getattr(node, "id", None),
                                                                             getattr(node, "name", None)):
                callers.append(relative)
    assert callers == []
