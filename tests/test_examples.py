"""Every example in README.md, docs/*.md and the --help epilogs runs as written (tests/examples.py finds them).

In-process through typer.testing.CliRunner, each in a folder of its own holding the files and models it
names; benchmarks/bench_examples.py times them as separate processes (docs/performance.md).
"""

from __future__ import annotations

import pytest
from examples import Example, all_examples, doc_examples, help_examples, model_names, prepare, provide_models

from attnscope.cli import app

EXAMPLES = all_examples(app)
MODELS = model_names(app, EXAMPLES)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return provide_models(tmp_path_factory.mktemp("models"), MODELS)


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{ex.where}: {ex.line}" for ex in EXAMPLES])
def test_example_runs_as_written(example: Example, runner, models, tmp_path, monkeypatch):
    import huggingface_hub.constants

    hub, folders = models
    prepare(tmp_path, example, folders)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    result = runner.invoke(app, timed_once(list(example.args)))
    if example.error is None:
        assert result.exit_code == example.status, f"{example.where}: {example.line}\n{result.output}"
    else:  # an example of a mistake: it fails, with the very line the docs show
        assert result.exit_code in (1, 2), result.output
        assert result.stderr.strip() == example.error


def timed_once(args: list[str]) -> list[str]:
    """A bench example as written, but timed once: its --runs and --warmup change how long, not whether, it runs
    (benchmarks/bench_examples.py times it as written)."""
    if args[:1] != ["bench"]:
        return args
    kept = [arg for previous, arg in zip(["", *args], args, strict=False)
            if arg not in ("--runs", "--warmup") and previous not in ("--runs", "--warmup")]
    return [*kept, "--runs", "1", "--warmup", "0"] if "--help" not in kept else kept


def test_every_command_help_ends_with_examples():
    import typer
    from examples import commands

    documented = {ex.where for ex in help_examples(app)}
    for path, _ in commands(typer.main.get_command(app)):
        where = f"attnscope {' '.join(path)} --help".replace("  ", " ")
        assert where in documented, f"{where} has no examples in its epilog"
        count = sum(ex.where == where for ex in help_examples(app))
        assert 2 <= count <= 3, f"{where} ends with {count} examples; give two or three"


def test_the_collector_finds_docs_examples_and_errors():
    found = {ex.line: ex for ex in doc_examples()}
    assert "attnscope sdpa --q q.npy --k k.npy --v v.npy --causal --check" in found  # README, with a comment
    mistake = found["attnscope sdpa --q q.npy --k k50.npy --v v40.npy"]  # docs/tutorial.md shows its error
    assert mistake.error is not None and mistake.error.startswith("attnscope: error: n_K = 50 but n_V = 40")
    assert not any(line.startswith("attnscope runs") for line in found)  # prose is not an example
