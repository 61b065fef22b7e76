"""An encoder-decoder on a long source or target (forward/seq2seq_long.py): every layer before L attends in blocks of
query rows (T5's bias made per block), layer L's head in blocks, pooled, its --rows exact against transformers'
eager `output_attentions` (float32, 1e-5) on tiny models with every weight moved (tests/tiny_encdec.py), with
LONG_TOKENS and BLOCK_ROWS made small so a sentence is long."""

from __future__ import annotations

import json
import re

import pytest
import torch
from tiny_encdec import SOURCE, TARGET, build, source_and_target


@pytest.fixture(scope="module")
def t5_and_bart(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    return {family: (root / family, build(family, root / family)) for family in ("t5", "bart")}


@pytest.fixture()
def small_blocks(monkeypatch):
    from attnscope.models.forward import long

    monkeypatch.setattr(long, "LONG_TOKENS", 8)
    monkeypatch.setattr(long, "BLOCK_ROWS", 3)


def _model(folder):
    from attnscope.models.config import read_config
    from attnscope.models.families import open_model

    return open_model(folder, read_config(folder))


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_t5_bias_of_a_block_is_those_rows_of_the_whole(t5_and_bart, kind):
    """compute_bias(b - a, n_K, past_seen_tokens=a) is rows a..b-1 of compute_bias(n, n)."""
    model = _model(t5_and_bart["t5"][0]).for_kind(kind)
    with model.checkpoint:
        whole = model.position_bias(1, 40, 40)
        block = model.position_bias(1, 7, 40, first=20)
    assert whole is not None and block is not None
    torch.testing.assert_close(block.bias, whole.bias[:, :, 20:27], rtol=0, atol=0)
    torch.testing.assert_close(block.buckets, whole.buckets[20:27], rtol=0, atol=0)


@pytest.mark.parametrize(("family", "kind"), [("t5", "encoder"), ("t5", "decoder"), ("t5", "cross"),
                                              ("bart", "encoder"), ("bart", "decoder"), ("bart", "cross")])
def test_a_sublayer_in_blocks_is_the_short_one(t5_and_bart, small_blocks, family, kind):
    """blocked_step gives the stream attention_step gives, which holds every head's whole pattern."""
    from attnscope.models.forward.seq2seq_long import blocked_step
    from attnscope.models.forward.seq2seq_run import attention_step

    model = _model(t5_and_bart[family][0])
    view = model.for_kind(kind)
    torch.manual_seed(0)
    h = torch.randn(1, 17, model.d_model)
    memory = torch.randn(1, 11, model.d_model) if kind == "cross" else None
    with model.checkpoint, torch.no_grad():
        mine = blocked_step(view, 1, h, memory)
        theirs = attention_step(view, 1, h, memory, record=False)[0]
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["encoder", "decoder", "cross"])
def test_long_rows_equal_eager_and_the_pooled_rows_sum_to_one(t5_and_bart, small_blocks, runner, kind):
    from attnscope.cli import app

    folder, eager = t5_and_bart["t5"]
    with torch.no_grad():
        out = eager(**source_and_target("t5", folder, eager), output_attentions=True)
    theirs = {"encoder": out.encoder_attentions, "decoder": out.decoder_attentions,
              "cross": out.cross_attentions}[kind][1][0, 2]  # layer 1, head 2: [n_Q, n_K]
    n_Q = theirs.shape[0]
    result = runner.invoke(app, ["head", "--model", str(folder), "--text", SOURCE, "--target", TARGET, "--attention",
                                 kind, "--layer", "1", "--head", "2", "--rows", f"0:{n_Q}", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert "attention" not in payload and payload["traced"] is True and payload["tracer"] == "attnscope"
    torch.testing.assert_close(torch.tensor(payload["rows"]["attention"]), theirs, rtol=1e-5, atol=1e-5)
    pooled = torch.tensor(payload["attention_pooled"])
    assert pooled.shape == theirs.shape  # a cell a token at this size
    torch.testing.assert_close(pooled.sum(-1), torch.ones(n_Q))
    names = [step["name"] for step in payload["layer_steps"]]
    assert ("memory" in names) == (kind == "cross") and ("position_buckets" in names) == (kind != "cross")


def test_the_terminal_labels_the_target_rows_and_source_keys(t5_and_bart, small_blocks, runner):
    """Across, the exact rows are target tokens and their keys source tokens, even where the target is longer."""
    from attnscope.cli import app

    folder = t5_and_bart["t5"][0]
    target = TARGET + " " + TARGET + " " + TARGET
    result = runner.invoke(app, ["head", "--model", str(folder), "--text", "The cat sat on the mat.", "--target",
                                 target, "--attention", "cross", "--rows", "20:22"])
    assert result.exit_code == 0, result.output
    assert "cross layer 0's attention on" in result.stdout and "target tokens over" in result.stdout
    assert re.search(r"^q20 \S+: ", result.stdout, re.M) and re.search(r"^q21 \S+: ", result.stdout, re.M)


@pytest.mark.parametrize(("args", "line"), [
    (["--all-heads"], "--text is 13 tokens, more than 8: the pattern is computed in blocks for the head asked only, "
                      "and --all-heads would hold every head's whole pattern; drop --all-heads, or shorten it"),
    (["--rows", "5:14"], "--rows 5:14: the encoder attention's queries are the 13 source tokens, so rows run 0 to 12"),
    (["--attention", "decoder", "--target", SOURCE + " " + SOURCE, "--generate", "2"],
     "--target is 25 tokens, more than 8: the pattern is computed in blocks for the head asked only, and --generate "
     "would hold every head's whole pattern; drop --generate, or shorten it"),
])
def test_what_a_long_input_cannot_do_is_one_line(t5_and_bart, small_blocks, runner, args, line):
    from attnscope.cli import app

    result = runner.invoke(app, ["head", "--model", str(t5_and_bart["bart"][0]), "--text", SOURCE, *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"attnscope: error: {line}"]


def test_rows_of_a_short_input_are_refused(t5_and_bart, runner):
    from attnscope.cli import app

    result = runner.invoke(app, ["head", "--model", str(t5_and_bart["bart"][0]), "--text", SOURCE, "--rows", "0:2"])
    assert result.exit_code == 2, result.output
    line = ("--rows picks exact query rows of a pattern that is pooled, and there are 13 source tokens, at most 2,048: "
            "the whole pattern is exact; drop --rows")
    assert result.stderr.strip().splitlines() == [f"attnscope: error: {line}"]


def test_the_memory_guard_says_the_blocked_estimate(t5_and_bart, small_blocks, runner):
    from attnscope.cli import app

    result = runner.invoke(app, ["head", "--model", str(t5_and_bart["t5"][0]), "--text", SOURCE, "--max-memory",
                                 "1KB"])
    assert result.exit_code == 1, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "in blocks needs" in result.stderr


def test_the_estimate_grows_with_n_not_n_squared(t5_and_bart):
    """Doubling a 6,000-token source adds about what 6,000 tokens cost (weights aside), not three times it."""
    from attnscope.models.forward.seq2seq_long import estimate_bytes

    model = _model(t5_and_bart["t5"][0])
    weights = estimate_bytes(model, "cross", 2, 0, 0)
    one, two = (estimate_bytes(model, "cross", 2, n, 10) - weights for n in (6000, 12000))
    assert 1.9 < two / one < 2.1
