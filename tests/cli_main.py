"""`attnscope.cli.main` (what the console script, `cli:run`, runs before it exits), run in this process: exit
status, stdout and stderr apart.

CliRunner.invoke runs the Typer app in click's standalone mode, which draws usage errors in a box; `main`
is what a user's shell runs, and where "one line on stderr" is promised.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass

from typer.testing import CliRunner

INTERNAL = "run again with --debug"  # the internal-error phrase: for real bugs only


def unwrapped(stderr: str) -> str:
    """stderr with each message on one line again: messages are wrapped to the terminal (80 columns here), their
    later lines indented two spaces (render/console.message_lines); the tests read and count messages."""
    return re.sub(r"\n  (?=\S)", " ", stderr)


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str  # each message on one line (`unwrapped`)
    wrapped: str = ""  # stderr as written

    @property
    def error_lines(self) -> list[str]:
        return self.stderr.splitlines()

    def json(self) -> object:
        """The --json output, parsed strictly: NaN or Infinity anywhere fails."""
        return json.loads(self.stdout, parse_constant=_no_constant)


def _no_constant(name: str) -> object:
    raise AssertionError(f"JSON output holds {name}")


def run_main(*args: str, env: dict[str, str] | None = None) -> Outcome:
    from attnscope.cli import main

    runner = CliRunner()
    argv = sys.argv
    with runner.isolation(env={"COLUMNS": "80", "NO_COLOR": "1", **(env or {})}) as (stdout, stderr, _):
        sys.argv = ["attnscope", *args]
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        finally:
            sys.argv = argv
            sys.stdout.flush()
            sys.stderr.flush()
        out, err = stdout.getvalue().decode(), stderr.getvalue().decode()
    return Outcome(code, out, unwrapped(err), err)


def assert_usage_error(outcome: Outcome, *words: str) -> None:
    """Exit 2, one line on stderr, no internal-error phrase, and the words that say what to fix."""
    assert outcome.code == 2, (outcome.code, outcome.stderr)
    assert len(outcome.error_lines) == 1, outcome.stderr
    assert outcome.stderr.startswith("attnscope: error: "), outcome.stderr
    assert INTERNAL not in outcome.stderr, outcome.stderr
    for word in words:
        assert word in outcome.stderr, (word, outcome.stderr)
