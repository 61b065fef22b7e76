"""Whisper's encoder positions are audio, not tokens: the readings' views (render/readings.py: the moved table with
--all-heads, the sinks grid and the rollout with --all-layers) name key 0 by its time, "the audio's first 20 ms
(position 0)", in the encoder and across (whose keys are the encoder's positions), never "the first token"; the
decoder's keys are text and keep "the first token". The span and times are transformers' WhisperFeatureExtractor's
(conv2's stride: two hops a position), the weights on key 0 its eager output_attentions'. At 80 columns, NO_COLOR=1,
on the tiny Whisper (tests/tiny_encdec.py: every weight perturbed)."""

from __future__ import annotations

import re

import pytest
import torch
from tiny_encdec import TARGET, build, feature_extractor, source_and_target

from attnscope.render.readings import audio_words

ENV = {"NO_COLOR": "1", "COLUMNS": "80"}


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """The folder and transformers' eager output_attentions on speech.wav and TARGET."""
    folder = tmp_path_factory.mktemp("whisper")
    model = build("whisper", folder)
    with torch.no_grad():
        out = model(**source_and_target("whisper", folder, model), output_attentions=True)
    return folder, out


def _span() -> tuple[float, str]:
    """Seconds each encoder position spans, from the feature extractor: two hops (conv2's stride 2), and in ms."""
    extractor = feature_extractor()
    each = 2 * extractor.hop_length / extractor.sampling_rate
    return each, f"{1000 * each:g} ms"


def _head(runner, folder, *more: str) -> str:
    from attnscope.cli import app

    out = runner.invoke(app, ["head", "--model", str(folder), "--audio", str(folder / "speech.wav"), "--layer", "1",
                              "--head", "0", *more], env=ENV)
    assert out.exit_code == 0, out.output
    assert "\x1b[" not in out.stdout and max(map(len, out.stdout.splitlines())) <= 80
    return out.stdout


def _after(text: str, title: str) -> str:
    return text[text.index(title):]


def _first_percents(section: str, n_head: int) -> list[int]:
    """The moved table's `<key 0> %` column, a row per head (head, moved, key 0 %, ...)."""
    rows = [line.split() for line in section.splitlines() if re.fullmatch(r"\s*\d+\s+\S+\s+\d+.*", line)]
    return [int(row[2]) for row in rows[:n_head]]


@pytest.mark.parametrize("kind", ["encoder", "cross"])
def test_moved_table_names_the_audio(whisper, runner, kind):
    """--all-heads: the column is `0.00s %` and its legend the audio's first 20 ms; each head's figure is the mean
    over queries of transformers' weight on key 0, in %."""
    folder, out = whisper
    target = ["--attention", "cross", "--target", TARGET] if kind == "cross" else []
    section = _after(_head(runner, folder, "--all-heads", *target), "what each head moves")
    shown = " ".join(section.split())
    _, span = _span()
    assert "0.00s % value-wtd 0.00s %" in shown
    assert f"0.00s %: its weight on the audio's first {span} (position 0)" in shown
    assert "first token" not in shown and "first %" not in shown
    legend = " ".join(_head(runner, folder, "--all-heads", *target).split())  # the heads table's legend too
    assert f"first: the audio's first {span} (position 0) (the \"sink\")" in legend and "first token" not in legend
    attentions = (out.encoder_attentions if kind == "encoder" else out.cross_attentions)[1][0]  # [n_head, n_Q, n_K]
    expected = [round(100 * float(weight)) for weight in attentions[:, :, 0].double().mean(dim=-1)]
    assert all(abs(a - b) <= 1 for a, b in zip(_first_percents(section, len(expected)), expected, strict=True))


def test_sinks_view_and_rollout_name_the_audio(whisper, runner):
    """--all-layers: the sinks grid's title and legend name the audio's first 20 ms, each layer's row transformers'
    weights on key 0; the rollout's last query is the last position's audio, by the time it starts at."""
    folder, out = whisper
    text = _head(runner, folder, "--all-layers")
    sinks = _after(text, "sinks: where each head parks its weight")
    shown = " ".join(sinks.split())
    each, span = _span()
    assert f"weight on the audio's first {span} (position 0), % (mean over queries)" in shown
    assert f"parks its weight on the audio's first {span} (position 0) but moves little" in shown
    n = out.encoder_attentions[0].shape[-1]
    assert f"rollout, the audio at {(n - 1) * each:.2f}s (position {n - 1}) draws from:" in shown
    assert "first token" not in shown and "the last token" not in shown
    for layer, attention in enumerate(out.encoder_attentions):
        row = next(line for line in sinks.splitlines() if line.startswith(f"layer {layer} "))
        expected = [round(100 * float(w)) for w in attention[0, :, :, 0].double().mean(dim=-1)]
        assert all(abs(int(a) - b) <= 1 for a, b in zip(row.split()[2:], expected, strict=True)), row


def test_the_decoders_keys_are_text(whisper, runner):
    """The decoder's self-attention reads the target's tokens: its key 0 stays "the first token"."""
    folder, _ = whisper
    shown = " ".join(_after(_head(runner, folder, "--all-heads", "--attention", "decoder", "--target", TARGET),
                            "what each head moves").split())
    assert "first % value-wtd first %" in shown and "its weight on the first token" in shown
    assert "audio" not in shown


def test_audio_words_reads_only_audio_positions():
    """Whisper's labels (models/audio.py's `position_labels`, times as the feature extractor spaces them) and
    nothing else: a text's tokens, an image's patches, times that do not start at 0 or run backwards."""
    from attnscope.models.audio import position_labels

    each, span = _span()
    labels = position_labels(50, each)
    assert audio_words(labels) == f"the audio's first {span} (position 0)"
    assert audio_words(labels, 49) == "the audio at 0.98s (position 49)"
    assert audio_words(["0.00s"]) == "the audio at 0.00s (position 0)"
    for other in (["The", "Ġcat"], ["[CLS]", "p(0,0)"], ["0.02s", "0.04s"], ["0.00s", "0.04s", "0.02s"],
                  ["0.00s", "cat"], []):
        assert audio_words(other) is None


def test_the_page_names_the_audio(whisper, tmp_path):
    """The page's sinks picker says the audio at 0.00s where the terminal says the audio's first 20 ms."""
    from browser import browser, chromium, open_page
    from cli_main import run_main

    folder, _ = whisper
    executable = chromium()
    assert executable is not None, "no Chromium found: the page is tested in a real browser"
    page = tmp_path / "whisper.html"
    assert run_main("head", "--model", str(folder), "--audio", str(folder / "speech.wav"), "--all-layers",
                    "--html", str(page)).code == 0
    with browser(executable) as context:
        opened = open_page(context, page)
        assert not opened.errors
        options = opened.page.locator("[data-testid=sinks-measure] option").all_inner_texts()
        assert "weight on the audio at 0.00s (position 0)" in options
        assert not any("first token" in option for option in options)
