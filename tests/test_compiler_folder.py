"""No stray `$TMPDIR/torchinductor_<user>` (issue 36, fuzz 4): the paths that still import torch._dynamo (a chunk
mask's `//` on the meta device, transformers' modeling files through `torch.compiler.disable`) leave no folder
behind (cli/compiler_folder.py), and an out-of-range --head of a family run through transformers is refused before
its layers run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from cli_main import run_main
from test_metadevice import PROBE  # runs main on each argv, then names the compiler modules imported

from attnscope.cli.compiler_folder import CACHE_VARIABLE, compiler_folder_kept_out, default_folder


def test_runs_that_import_torchs_compiler_leave_tmpdir_empty(tmp_path):
    from tiny_interface import build

    np.save(tmp_path / "q.npy", np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32))
    build("gpt_neox", tmp_path / "gpt_neox")
    runs = [["sdpa", "--q", str(tmp_path / "q.npy"), "--chunk", "6"], ["sdpa", "--rope", "--check"],
            ["head", "--model", str(tmp_path / "gpt_neox"), "--text", "x"]]
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir), "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
    env.pop(CACHE_VARIABLE, None)
    result = subprocess.run([sys.executable, "-c", PROBE.format(runs=runs)],
                            capture_output=True, text=True, env=env, timeout=600,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "'torch._dynamo'" in result.stdout  # the import happened, and yet:
    assert list(tmpdir.iterdir()) == []


def test_only_an_empty_folder_the_run_made_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv(CACHE_VARIABLE, raising=False)
    monkeypatch.setattr("tempfile.tempdir", None)  # tempfile caches the folder it found first
    folder = Path(default_folder())
    assert folder.parent == tmp_path and folder.name.startswith("torchinductor_")

    def make(contents: bool) -> None:  # what torch's cache_dir() does on import
        folder.mkdir(exist_ok=True)
        os.environ[CACHE_VARIABLE] = str(folder)
        if contents:
            (folder / "kept").write_text("a compiled kernel")

    with compiler_folder_kept_out():
        make(contents=False)
    assert not folder.exists()
    del os.environ[CACHE_VARIABLE]
    with compiler_folder_kept_out():
        make(contents=True)
    assert (folder / "kept").exists()  # not empty: left alone
    (folder / "kept").unlink()
    del os.environ[CACHE_VARIABLE]
    with compiler_folder_kept_out():  # there before the run: left alone
        make(contents=False)
    assert folder.is_dir()


def test_an_out_of_range_head_is_refused_before_the_layers_run(tmp_path, monkeypatch):
    from tiny_interface import build

    from attnscope.models.nopage import truncated

    build("gpt_neox", tmp_path / "gpt_neox")
    monkeypatch.setattr(truncated, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("layers ran")))
    outcome = run_main("head", "--model", str(tmp_path / "gpt_neox"), "--text", "x", "--head", "4")
    assert outcome.code == 2, outcome.stderr
    assert outcome.stderr.startswith("attnscope: error: --head 4 is out of range: this model has 4 heads, 0 to 3")
