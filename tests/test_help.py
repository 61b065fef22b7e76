"""--help as it renders with the Typer and Click installed: flags read as flags, -h works, completion installs."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import typer
from cli_main import assert_usage_error, run_main
from examples import commands

from attnscope.cli import app

TREE = [(list(path), command) for path, command in commands(typer.main.get_command(app))]


@pytest.mark.parametrize(("path", "command"), TREE, ids=[" ".join(p) or "attnscope" for p, _ in TREE])
def test_flags_render_as_flags_and_h_is_help(path, command, runner):
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "<bool>" not in text and "BOOLEAN" not in text  # a flag takes no value: `--check true` is an error
    for param in command.params:
        if getattr(param, "is_flag", False) and not param.hidden:
            for opt in param.opts:  # the flag, then its help or its negative form, no value type in between
                assert re.search(rf"{re.escape(opt)}\s+(--no-\S+\s+)?[A-Z]", text), f"{opt} in {path}"
    assert re.search(r"--help\s+-h\s+Show this message", text)
    short = runner.invoke(app, [*path, "-h"], env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert short.exit_code == 0 and short.stdout == text


def test_a_flag_given_a_value_is_told_so(runner):
    result = runner.invoke(app, ["sdpa", "--check", "true"])
    assert result.exit_code == 2 and "true" in result.output
    # What the user's shell gets: one line that names the flag and what to write instead.
    assert_usage_error(run_main("sdpa", "--check", "true"), "--check is a flag", "write '--check' alone")
    assert_usage_error(run_main("mha", "--json", "False"), "--json is a flag", "leave it out")
    assert_usage_error(run_main("bert", "--all-heads", "1"), "--all-heads is a flag")
    # A value after an option that takes one is not a flag's: Click's own line stays.
    assert_usage_error(run_main("sdpa", "--nq", "3", "1"), "unexpected extra argument")
    assert_usage_error(run_main("sdpa", "extra"), "unexpected extra argument")


def _attnscope(args: str, home: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run as a user's shell would (completion finds its shell from the parent process). `; exit $?` keeps bash
    from exec-ing the command in its place, so the parent is bash whatever runs the tests (pytest under
    `timeout`, a CI runner)."""
    environ = {**os.environ, "HOME": home, "SHELL": "/bin/bash", **env}
    command = f"{sys.executable} -m attnscope {args}; exit $?"
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=environ, timeout=120)


def test_shell_completion_shows_installs_and_completes(tmp_path):
    shown = _attnscope("--show-completion", str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    assert "_ATTNSCOPE_COMPLETE" in shown.stdout and "complete " in shown.stdout
    installed = _attnscope("--install-completion", str(tmp_path))
    assert installed.returncode == 0, installed.stderr
    script = tmp_path / ".bash_completions" / "attnscope.sh"
    assert script.is_file() and f"source '{script}'" in (tmp_path / ".bashrc").read_text()
    completed = _attnscope("", str(tmp_path), _ATTNSCOPE_COMPLETE="complete_bash", COMP_WORDS="attnscope be",
                           COMP_CWORD="1")
    assert completed.stdout.split() == ["bert", "bench"]
    options = _attnscope("", str(tmp_path), _ATTNSCOPE_COMPLETE="complete_bash", COMP_WORDS="attnscope sdpa --heatm",
                         COMP_CWORD="2")
    assert {"--heatmap", "--heatmap-batch", "--heatmap-head"} <= set(options.stdout.split())
