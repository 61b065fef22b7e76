"""The width output is drawn at: COLUMNS when it is a width a terminal can have, else the terminal's, else
(piped) 80; and `attnscope --help` that never breaks a sentence mid-way (issue 18)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import typer
from cli_main import assert_usage_error, run_main
from rich.cells import cell_len

from attnscope.cli import app

NONSENSE = ["0", "-1", "abc", "", " ", "1e3", "100000", "99999999999999999999", "5"]


@pytest.mark.parametrize("columns", NONSENSE)
def test_nonsense_columns_read_as_unset(columns, tmp_path):
    """COLUMNS=0 printed nothing and exited 0 (and --svg still wrote a file); 100000 padded --help to 4 MB."""
    svg = tmp_path / "mask.svg"
    outcome = run_main("mask", "--nq", "3", "--causal", "--svg", str(svg), env={"COLUMNS": columns})
    assert outcome.code == 0, outcome.stderr
    lines = outcome.stdout.splitlines()
    assert "■" in outcome.stdout and lines and max(cell_len(line) for line in lines) <= 80, outcome.stdout
    assert svg.is_file()
    helped = run_main("--help", env={"COLUMNS": columns})
    widths = [cell_len(line) for line in helped.stdout.splitlines()]
    assert helped.code == 0 and "Commands" in helped.stdout and max(widths) <= 80, helped.stdout[:500]


@pytest.mark.parametrize("columns", ["60", "120", " 90 "])
def test_sensible_columns_are_kept(columns):
    outcome = run_main("mha", "--nq", "5", "--batch", "2", env={"COLUMNS": columns})
    width = max(cell_len(line) for line in outcome.stdout.splitlines())
    assert 80 < width <= int(columns) if int(columns) > 80 else width <= int(columns), outcome.stdout


def test_piped_output_is_80_columns():
    """No COLUMNS and no terminal (`attnscope mha | less`): 80 columns, notes wrapped at 80 (they were at 100)."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    result = subprocess.run([sys.executable, "-c", "from attnscope.cli import main; main()", "mha", "--d-feat", "64",
                             "--heads", "4", "--nq", "50", "--batch", "2", "--all-heads"], capture_output=True,
                            text=True, env={**env, "NO_COLOR": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr
    widths = [cell_len(line) for line in result.stdout.splitlines()]
    assert max(widths) <= 80, max(widths)
    assert max(widths) >= 70  # the width is used, not a narrower fallback


def _summaries() -> dict[str, str]:
    group = typer.main.get_command(app)
    return {name: " ".join(command.help.split("\n\n")[0].split()) for name, command in group.commands.items()}


def test_help_never_breaks_a_sentence_mid_way():
    """Typer's command list kept a docstring's line breaks: "and write it for / F.scaled_dot_product_attention"."""
    wide = run_main("--help", env={"COLUMNS": "1000"}).stdout
    lines = [" ".join(line.strip(" │").split()) for line in wide.splitlines()]
    for name, summary in _summaries().items():
        assert any(line == f"{name} {summary}" for line in lines), (name, summary)


def test_mask_refuses_what_sdpa_refuses():
    assert_usage_error(run_main("mask", "--mask", ""), "--mask ''", "an empty file name")
    assert_usage_error(run_main("mask", "--window", str(2**63)), "--window 9223372036854775808", "64-bit")
    assert_usage_error(run_main("sdpa", "--window", str(2**63)), "--window 9223372036854775808", "64-bit")


@pytest.mark.parametrize("columns", ["80", "50"])
def test_values_keep_each_tensor_row_on_its_line(columns):
    """Issue 36, item 5: torch printed --values rows 96 wide and Rich wrapped them at 80, the last number of a
    row landing at column 0. torch now wraps them itself, at the width, between numbers."""
    outcome = run_main("sdpa", "--values", "--batch", "1", "--nq", "8", "--nk", "8", "--dk", "8", "--dv", "8",
                       env={"COLUMNS": columns})
    assert outcome.code == 0, outcome.stderr
    values = outcome.stdout[outcome.stdout.index("Q [1, 8, 8]"):].splitlines()
    assert max(cell_len(line) for line in values) <= int(columns), outcome.stdout
    assert not [line for line in values if line[:1].isdigit() or line[:1] == "-"], outcome.stdout  # at column 0
