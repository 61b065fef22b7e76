"""The path of one command (issue 44, goal 5): the CLI imports only the command being run (attnscope/cli/commands.py),
and one head imports no module it does not use: no other command's, no table it does not draw, no page without
--html. Each case runs in a fresh interpreter and reads its `sys.modules` at exit; `--help` still lists every
command, in Typer's order, and a mistyped command is still answered with the one it resembles."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_main import unwrapped
from tiny_models import SENTENCE, build

from attnscope.cli.commands import COMMANDS

# What one head never needs: the other commands' modules, their tables, the page's builder, the user's code.
NOT_ON_A_HEAD = [*(f"attnscope.cli.{module}" for name, module in COMMANDS.items() if name != "head"),
                 "attnscope.cli.shared_run", "attnscope.render.anatomy", "attnscope.render.bench",
                 "attnscope.render.results", "attnscope.views.sources", "attnscope.usertrace",
                 "attnscope.watching"]

RUN = """
import sys
from attnscope.cli import main
sys.argv = ['attnscope', *sys.argv[1:]]
try:
    main()
except SystemExit as exit:
    code = exit.code
print('EXIT', code, file=sys.stderr)
print('MODULES', *sorted(name for name in sys.modules if name.startswith('attnscope')), file=sys.stderr)
"""


def _run(*args: str, env: dict[str, str] | None = None) -> tuple[str, set[str], str]:
    done = subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, timeout=300, env=env)
    lines = done.stderr.splitlines()
    modules = set(next(line for line in lines if line.startswith("MODULES")).split()[1:])
    exit_line = next(line for line in lines if line.startswith("EXIT"))
    return exit_line, modules, done.stdout + unwrapped("\n".join(lines[:-2]))


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    build("llama", folder)
    return folder


@pytest.mark.parametrize("text", [False, True], ids=["weights", "text"])
def test_one_head_imports_only_what_it_uses(llama, text):
    args = ["head", "--model", str(llama), "--layer", "1", "--head", "2", *(["--text", SENTENCE] if text else [])]
    exit_line, modules, output = _run(*args)
    assert exit_line == "EXIT 0", output
    assert "attnscope.cli.head" in modules and "W_Q" in output
    loaded = sorted(name for name in modules if any(name == n or name.startswith(f"{n}.") for n in NOT_ON_A_HEAD))
    assert loaded == [], loaded


def test_a_mistyped_command_builds_none_and_is_told_the_nearest():
    exit_line, modules, output = _run("hed")
    assert exit_line == "EXIT 2"
    assert "No such command 'hed'. Did you mean 'head'?" in output
    assert not {f"attnscope.cli.{module}" for module in COMMANDS.values()} & modules


def test_help_lists_every_command_in_typers_order():
    import os

    exit_line, modules, output = _run("--help", env={**os.environ, "NO_COLOR": "1", "COLUMNS": "80"})
    assert exit_line == "EXIT 0"
    listed = [line.split()[1] for line in output.splitlines() if line.startswith("│ ") and len(line.split()) > 2
              and line.split()[1] in COMMANDS]
    # Typer's order before the commands were loaded lazily: the commands as registered, then the sub-app (bench).
    assert listed == ["sdpa", "mha", "mask", "bert", "head", "trace", "anatomy", "diff", "bench"]
    assert {f"attnscope.cli.{module}" for module in COMMANDS.values()} <= modules
