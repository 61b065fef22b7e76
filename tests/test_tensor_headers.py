"""A tensor file whose header declares more than its data holds (issue 36, fuzz 2): refused from the header, in one
line and exit 2, before any data is read, by every command that reads it (`diff`, which reads data late, and
`--meta`, which reads none), for every format: .npy, .npz (stored and compressed), .safetensors, .pt.
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_main import INTERNAL, run_main
from safetensors.torch import save_file

from attnscope import load_tensor
from attnscope.errors import UsageError


def _npy_claiming(shape: str) -> bytes:
    """A [2, 3] float32 .npy whose header says `shape`."""
    from io import BytesIO

    buffer = BytesIO()
    np.save(buffer, np.ones((2, 3), np.float32))
    return buffer.getvalue().replace(b"(2, 3)", shape.encode())


def _safetensors(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _rewrite_pt(source: Path, target: Path, edit) -> None:
    """A copy of a torch.save archive with one record edited: what a damaged download looks like."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as new:
        for info in old.infolist():
            new.writestr(info, edit(info.filename, old.read(info.filename)))


def _write_damaged(folder: Path) -> dict[str, str]:
    """name -> the words the refusal says."""
    (folder / "shape.npy").write_bytes(_npy_claiming("(4, 3)"))
    with zipfile.ZipFile(folder / "shape.npz", "w") as archive:
        archive.writestr("q.npy", _npy_claiming("(4, 3)"))
    with zipfile.ZipFile(folder / "deflated.npz", "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("q.npy", _npy_claiming("(4, 3)"))
    f32 = {"dtype": "F32", "data_offsets": [0, 24]}
    _safetensors(folder / "shape.safetensors", {"q": {**f32, "shape": [4, 3]}}, bytes(24))
    _safetensors(folder / "overflow.safetensors", {"q": {**f32, "shape": [2**40, 2**40]}}, bytes(24))
    _safetensors(folder / "gap.safetensors", {"q": {"dtype": "F32", "shape": [2, 3], "data_offsets": [8, 32]}},
                 bytes(32))
    _safetensors(folder / "overlap.safetensors", {"q": {**f32, "shape": [2, 3]}, "k": {**f32, "shape": [2, 3]}},
                 bytes(24))
    _safetensors(folder / "trailing.safetensors", {"q": {**f32, "shape": [2, 3]}}, bytes(32))
    _safetensors(folder / "negative.safetensors", {"q": {**f32, "shape": [-2, -3]}}, bytes(24))
    _safetensors(folder / "metadata.safetensors", {"__metadata__": {"a": 1}, "q": {**f32, "shape": [2, 3]}},
                 bytes(24))
    torch.save({"q": torch.ones(2, 3)}, folder / "good.pt")
    _rewrite_pt(folder / "good.pt", folder / "short.pt", lambda name, data: data[:8] if "/data/" in name else data)
    return {"shape.npy": "declares [4, 3] float32 (48 bytes) but only 24", "shape.npz": "only 24 bytes of data",
            "deflated.npz": "only 24 bytes of data", "shape.safetensors": "declared [4, 3] F32 (48 bytes)",
            "overflow.safetensors": "but holds 24 bytes", "gap.safetensors": "starts at byte 8",
            "overlap.safetensors": "starts at byte 0 of the data, not at 24",
            "trailing.safetensors": "take 24 bytes of the 32", "negative.safetensors": "malformed entry",
            "metadata.safetensors": "__metadata__ is not a map of strings",
            "short.pt": "declared 24 bytes but its record in the archive holds 8"}


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    folder = tmp_path_factory.mktemp("damaged")
    return folder, _write_damaged(folder)


def test_a_header_that_declares_more_than_the_file_holds_is_refused_before_reading(damaged):
    folder, words = damaged
    for name, said in words.items():
        for meta in (False, True):
            with pytest.raises(UsageError) as refused:
                load_tensor(str(folder / name) + (":q" if name.endswith("npz") else ""), meta=meta)
            assert said in str(refused.value), (name, meta, str(refused.value))


def test_diff_of_a_damaged_file_is_one_line_and_exit_2(damaged, tmp_path):
    folder, words = damaged
    for name in words:
        suffix = Path(name).suffix
        good = tmp_path / f"good{suffix}"
        if suffix == ".safetensors":
            save_file({"q": torch.ones(2, 3)}, good)
        elif suffix == ".npz":
            np.savez(good, q=np.ones((2, 3), np.float32))
        elif suffix == ".npy":
            np.save(good, np.ones((2, 3), np.float32))
        else:
            torch.save({"q": torch.ones(2, 3)}, good)
        outcome = run_main("diff", str(good), str(folder / name))
        assert outcome.code == 2, (name, outcome.code, outcome.stderr)
        assert len(outcome.error_lines) == 1 and INTERNAL not in outcome.stderr, (name, outcome.stderr)


def test_an_archive_damaged_past_its_header_is_one_line_when_diff_reads_it(tmp_path):
    """The CRC of a stored member fails only once its data is read, after the headers were accepted."""
    np.savez(tmp_path / "a.npz", q=np.ones((64, 1024), np.float32))
    damaged = bytearray((tmp_path / "a.npz").read_bytes())
    damaged[200_000] ^= 0xFF
    (tmp_path / "b.npz").write_bytes(bytes(damaged))
    outcome = run_main("diff", str(tmp_path / "a.npz"), str(tmp_path / "b.npz"))
    assert outcome.code == 2 and "a damaged .npz archive (Bad CRC-32" in outcome.stderr, outcome.stderr
    assert INTERNAL not in outcome.stderr
