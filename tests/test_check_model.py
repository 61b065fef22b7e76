"""`head --check`: the run held against transformers' own eager run of the checkpoint at run time
(runs/check_model.py). It PASSes where attnscope is right (tests/test_conformance.py's "check" column) and FAILs,
exit 1 after showing everything, where attnscope's forward is planted a mistake transformers does not make."""

from __future__ import annotations

import json

import pytest
from tiny_models import SENTENCE, build, cached_builder

from attnscope.cli import app


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return cached_builder(tmp_path_factory, build)


def test_a_planted_mistake_fails_the_check(built, runner, monkeypatch):
    """Mistral's window dropped from attnscope's forward: layer 1's pattern differs from eager's, --check says
    FAIL for it, exit 1, and the table and JSON still show everything."""
    from attnscope.models.families.mistral import Mistral

    folder, _ = built("mistral")
    monkeypatch.setattr(Mistral, "window", lambda self, layer: None if layer == 1 else 4)
    result = runner.invoke(app, ["head", "--model", str(folder), "--layer", "1", "--text", SENTENCE, "--all-layers",
                                 "--check", "--json"])
    assert result.exit_code == 1, result.output
    payload = json.loads(result.stdout)
    verdicts = {c["name"]: c["passed"] for c in payload["check"]}
    assert verdicts == {"layer 0": True, "layer 1": False} and payload["check_passed"] is False
    table = runner.invoke(app, ["head", "--model", str(folder), "--layer", "1", "--text", SENTENCE, "--check"],
                          env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert table.exit_code == 1 and "FAIL" in table.stdout and "check against transformers" in table.stdout


def test_a_long_inputs_exact_rows_are_checked(built, runner, monkeypatch):
    from attnscope.models.forward import long

    folder, _ = built("qwen2")
    monkeypatch.setattr(long, "LONG_TOKENS", 8)
    monkeypatch.setattr(long, "BLOCK_ROWS", 5)
    result = runner.invoke(app, ["head", "--model", str(folder), "--layer", "2", "--head", "1", "--text", SENTENCE,
                                 "--rows", "3:12", "--check", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [c["name"] for c in payload["check"]] == ["layer 2 head 1 rows 3:12"] and payload["check_passed"]


@pytest.mark.parametrize(("args", "code", "says"), [
    (["--check"], 2, "add --text"),
    # the run fits, transformers' whole model with every layer's attention does not: refused before it loads
    (["--text", SENTENCE, "--all-layers", "--check", "--max-memory", "400KB"], 1, "--check: transformers' eager run"),
])
def test_bad_checks_are_one_line(built, runner, args, code, says):
    folder, _ = built("llama")
    result = runner.invoke(app, ["head", "--model", str(folder), *args])
    assert result.exit_code == code and says in result.stderr, result.output
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) <= 3
