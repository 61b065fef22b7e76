"""--text-file read by runs/inputs.py: a device, an empty or blank file, a folder and a missing one each get one line
naming the file and what was wrong, exit 2, before any model is looked for."""

from __future__ import annotations

import pytest

from attnscope.cli import app


@pytest.mark.parametrize(("make", "says"), [
    (lambda tmp: "/dev/zero", "--text-file /dev/zero is not a regular file, and gives more than the 8,388,608 bytes"),
    (lambda tmp: "/dev/null", "--text-file /dev/null is empty (0 bytes); give a file with the text"),
    (lambda tmp: _file(tmp, b""), "empty.txt is empty (0 bytes); give a file with the text"),
    (lambda tmp: _file(tmp, b"  \n\t\n"), "empty.txt holds only 5 bytes of blank space; give a file with the text"),
    (lambda tmp: str(tmp), "is a folder; give a text file"),
    (lambda tmp: str(tmp / "missing.txt"), "missing.txt: no such file"),
])
def test_a_text_file_that_is_no_text_is_one_line(runner, tmp_path, make, says):
    path = make(tmp_path)
    result = runner.invoke(app, ["head", "--model", str(tmp_path / "no-model"), "--text-file", path])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and line.startswith(f"attnscope: error: --text-file {path}"), line
    assert says in line and "--text is empty" not in line, line


def _file(folder, data: bytes) -> str:
    path = folder / "empty.txt"
    path.write_bytes(data)
    return str(path)


def test_a_text_file_is_read_whole(tmp_path):
    from attnscope.runs.inputs import read_text_file

    path = tmp_path / "a.txt"
    path.write_text("The cat sat.\nOn the mat.\n", encoding="utf-8")
    assert read_text_file(str(path)) == "The cat sat.\nOn the mat.\n"
