"""Keys the mask hid are drawn `·`, apart from blank near-zero weights, in every terminal picture of a pattern: a
model head's heatmap, --all-heads' grid, --all-layers' traced layer, mha --all-heads (issue 36, item 7);
masks.hidden reads them from masked_scores (-inf, or a float mask's finfo.min)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import SENTENCE, build, cached_builder

from attnscope.cli import app
from attnscope.masks import hidden

LEGEND = "· = masked"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return cached_builder(tmp_path_factory, build)


def test_hidden_reads_minus_infinity_and_finfo_min_not_small_weights():
    scores = torch.tensor([[0.0, -torch.inf, torch.finfo(torch.float32).min, -1e30, torch.nan]])
    assert hidden(scores).tolist() == [[False, True, True, False, False]]


@pytest.mark.parametrize("args", [["--all-heads"], ["--all-layers"], []])
def test_a_windowed_models_pictures_mark_the_hidden_keys(built, runner, args):
    folder, _ = built("mistral")  # a window of 4: query 8 sees keys 5..8, keys 0..4 are hidden from it
    result = runner.invoke(app, ["head", "--model", str(folder), "--layer", "1", "--text", SENTENCE, *args],
                           env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert LEGEND in result.stdout and "·" in result.stdout.split(LEGEND)[0]


def test_a_bidirectional_model_has_no_hidden_keys(built, runner):
    folder, _ = built("bert")
    result = runner.invoke(app, ["head", "--model", str(folder), "--text", SENTENCE, "--all-heads"],
                           env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert result.exit_code == 0 and LEGEND not in result.stdout


def test_mha_all_heads_marks_the_causal_mask(runner):
    result = runner.invoke(app, ["mha", "--nq", "6", "--d-feat", "16", "--heads", "2", "--causal", "--all-heads"],
                           env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert LEGEND in result.stdout
