"""Every `attnscope head` and `attnscope bert` example of README.md, docs/*.md and the commands' --help runs, in
seconds, offline: tiny models stand in for the folders they name (./llama-dir, ./mistral-dir, ./my-bert) and,
in a Hugging Face cache of their own, for the Hub names (bert-base-uncased, gpt2), with the layer and head
counts the examples need."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from tiny_models import build

from attnscope.cli import app

ROOT = Path(__file__).resolve().parent.parent
# name in the examples -> (family, config overrides): enough layers and heads for every example's --layer/--head
STAND_INS = {
    "./llama-dir": ("llama", {"num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 8,
                              "hidden_size": 64, "head_dim": 2}),
    "./mistral-dir": ("mistral", {}),
    "./my-bert": ("bert", {"num_hidden_layers": 6, "num_attention_heads": 12}),
    "bert-base-uncased": ("bert", {"num_hidden_layers": 6, "num_attention_heads": 12}),
    "gpt2": ("gpt2", {"n_layer": 6, "n_head": 12}),
}


def _examples() -> list[str]:
    from typer.testing import CliRunner

    texts = [(ROOT / "README.md").read_text(), *(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))]
    for command in ("head", "bert"):
        texts.append(CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "300"}).stdout)
    lines = {line.strip().split("   #")[0].split("  #")[0].strip() for text in texts for line in text.splitlines()
             if line.strip().startswith(("attnscope head ", "attnscope bert "))}
    return sorted(lines)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Each stand-in model saved once: a folder, and for Hub names a snapshot in a Hugging Face cache layout."""
    root = tmp_path_factory.mktemp("stand-ins")
    folders = {}
    for name, (family, sizes) in STAND_INS.items():
        if name.startswith("./"):
            folder = root / "folders" / name[2:]
        else:
            repo = root / "hub" / f"models--{name.replace('/', '--')}"
            (repo / "refs").mkdir(parents=True)
            (repo / "refs" / "main").write_text("0" * 40)
            folder = repo / "snapshots" / ("0" * 40)
        build(family, folder, **sizes)
        folders[name] = folder
    return folders


@pytest.mark.parametrize("line", _examples())
def test_every_documented_head_and_bert_example_runs(runner, line, models, tmp_path, monkeypatch):
    import huggingface_hub.constants

    hub_cache = models["gpt2"].parents[2]  # .../hub/models--gpt2/snapshots/<commit>
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    for name, folder in models.items():
        if name.startswith("./"):
            (tmp_path / name[2:]).symlink_to(folder)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, shlex.split(line)[1:])
    assert result.exit_code == 0, (line, result.output)

