"""The family x view conformance matrix (attnscope/models/support.py): every "exact" cell equal to transformers'
eager `output_attentions` / `generate(output_attentions=True)` in float32 to 1e-5, on a tiny checkpoint whose every
weight was drawn away from its initial value; every other cell refused in one line. Through the command line, as
a user runs it, `--json`.

The long view runs with LONG_TOKENS and BLOCK_ROWS made small (the blocked path on a text past the block size, with
windows and chunks of 4 shorter than it); generate starts from a short prompt, so windows and chunks are crossed
while decoding.
"""

from __future__ import annotations

import json

import pytest
import torch
from conformance import BUILDERS, assert_trained_looking, attention_layers, eager_attentions
from tiny_models import SENTENCE, cached_builder

from attnscope.cli import app
from attnscope.models.families import FAMILIES
from attnscope.models.nopage.cache_names import cache_keyword
from attnscope.models.support import EXACT, LINEAR_HYBRID, ROWS, VIEWS

CELLS = [(row.family, view) for row in ROWS for view in VIEWS]
PROMPT = "The cat sat on"
NEW_TOKENS = 6
ATOL = 1e-5


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return cached_builder(tmp_path_factory, lambda family, folder: BUILDERS[family](folder))


def _json(runner, folder, *args: str) -> dict:
    result = runner.invoke(app, ["head", "--model", str(folder), *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _close(mine, theirs, what: str) -> None:
    torch.testing.assert_close(torch.tensor(mine, dtype=torch.float32), theirs.float(), atol=ATOL, rtol=0, msg=what)


def test_every_family_page_has_a_row_and_a_builder():
    """Adding a family adds a row; a row without a builder (or a page without a row) fails."""
    rows = {t for row in ROWS if row.page for t in row.model_types}
    assert rows == set(FAMILIES)
    assert {row.family for row in ROWS} == set(BUILDERS)
    assert all(set(row.views) == set(VIEWS) for row in ROWS)


def test_docs_show_the_matrix():
    from pathlib import Path

    from attnscope.models.support import markdown

    docs = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text(encoding="utf-8")
    assert markdown() in docs, "docs/models.md's matrix differs from support.py: run python scripts/support_table.py"


@pytest.mark.parametrize(("family", "view"), CELLS, ids=[f"{f}-{v}" for f, v in CELLS])
def test_cell(family, view, built, runner, monkeypatch):
    folder, eager = built(family)
    assert_trained_looking(folder)
    if family.startswith("vision:"):  # --image, not --text (tests/tiny_vision.py)
        from tiny_vision import conformance_cell

        conformance_cell(runner, app, folder, eager, view)
        return
    if family.startswith("vlm:"):  # --text with --image (tests/tiny_vlm.py)
        from tiny_vlm import conformance_cell as vlm_cell

        vlm_cell(runner, app, folder, eager, view, monkeypatch)
        return
    if row_of(family).views[view] != EXACT:
        _refused(runner, folder, family, view, monkeypatch)
        return
    {"short": _short, "long": _long, "generate": _generate, "all-layers": _all_layers, "check": _check}[view](
        runner, folder, eager, family, monkeypatch)


ENCODER_DECODERS = {"T5": "t5", "Umt5": "umt5", "Bart": "bart", "Marian": "marian", "MBart": "mbart",
                    "Whisper": "whisper"}


def _source(family: str, folder) -> list[str]:
    """What the command reads first: Whisper's encoder an audio file, every other family a text."""
    return ["--audio", str(folder / "speech.wav")] if family == "Whisper" else ["--text", SENTENCE]


def _short(runner, folder, eager, family, monkeypatch):
    if family in ENCODER_DECODERS:
        _short_encoder_decoder(runner, folder, eager, family)
        return
    layers = attention_layers(eager)
    first = _json(runner, folder, "--text", SENTENCE, "--all-heads", "--layer", str(layers[0]))
    theirs = eager_attentions(eager, first["token_ids"])
    assert len(theirs) == len(layers)
    for layer, pattern in zip(layers, theirs, strict=True):
        payload = first if layer == layers[0] else _json(runner, folder, "--text", SENTENCE, "--all-heads", "--layer",
                                                         str(layer))
        assert payload["traced"] is True and payload["tracer"] in ("attnscope", "attention-interface")
        for head in payload["heads"]:
            _close(head["attention"], pattern[head["head"]], f"{family} layer {layer} head {head['head']}")
    if family.startswith("hybrid:"):
        _no_attention_refused(runner, folder, eager, layers)


def _no_attention_refused(runner, folder, eager, layers):
    """A hybrid's layer without attention (a Mamba or convolution layer), in every view: one line naming the
    layers that have attention, exit 2."""
    other = next(i for i in range(eager.config.num_hidden_layers) if i not in layers)
    for more in ([], ["--all-layers"], ["--generate", "2"]):
        result = runner.invoke(app, ["head", "--model", str(folder), "--text", PROMPT, "--layer", str(other), *more])
        assert result.exit_code == 2, result.output
        line = f"the layers with attention are {', '.join(map(str, layers))}"
        assert result.stderr.count("\n") == 1 and line in result.stderr and "Traceback" not in result.stderr


def _short_encoder_decoder(runner, folder, eager, family):
    """Each of the three attentions, every layer and head, against the eager model on transformers' own inputs
    (tests/tiny_encdec.py: the source, or Whisper's features from its audio, and the target)."""
    for kind, theirs in _eager_attentions_encdec(folder, eager, family):
        for layer, pattern in enumerate(theirs):
            payload = _json(runner, folder, *_encdec_args(family, folder, kind, "--layer", str(layer), "--all-heads"))
            assert payload["traced"] is True and payload["tracer"] == "attnscope"
            for head in payload["heads"]:
                _close(head["attention"], pattern[0, head["head"]], f"{family} {kind} {layer} head {head['head']}")


def _long(runner, folder, eager, family, monkeypatch):
    from attnscope.models import tokenizer
    from attnscope.models.forward import long

    monkeypatch.setattr(long, "LONG_TOKENS", 8)
    monkeypatch.setattr(long, "BLOCK_ROWS", 5)
    if family in ENCODER_DECODERS:
        _long_encoder_decoder(runner, folder, eager, family)
        return
    ids = tokenizer.encode(folder, SENTENCE).ids
    assert len(ids) > 8
    theirs = eager_attentions(eager, ids)
    if not row_of(family).page:  # transformers runs the whole pattern
        layer = attention_layers(eager)[-1]  # (memory-guarded up front), not blocks
        payload = _json(runner, folder, "--text", SENTENCE, "--all-heads", "--layer", str(layer))
        for head in payload["heads"]:
            _close(head["attention"], theirs[-1][head["head"]], f"{family} long head {head['head']}")
        return
    for layer, pattern in zip(attention_layers(eager), theirs, strict=True):  # a linear hybrid's: its full layers
        head = layer % pattern.shape[0]  # a different head each layer
        payload = _json(runner, folder, "--text", SENTENCE, "--layer", str(layer), "--head", str(head), "--rows",
                        f"0:{len(ids)}")
        assert payload["token_ids"] == ids and "attention" not in payload  # the blocked path
        assert payload["traced"] is True and payload["tracer"] == "attnscope"
        _close(payload["rows"]["attention"], pattern[head], f"{family} long layer {layer} head {head}")


def _long_encoder_decoder(runner, folder, eager, family):
    """Each attention on a source (Whisper: its 50 audio positions) past LONG_TOKENS: every layer before L in blocks,
    layer L's head in blocks, all its rows asked exact against eager's encoder, decoder and cross attentions."""
    for kind, theirs in _eager_attentions_encdec(folder, eager, family):
        for layer, pattern in enumerate(theirs):
            head = layer % pattern.shape[1]
            payload = _json(runner, folder, *_encdec_args(family, folder, kind, "--layer", str(layer), "--head",
                                                          str(head), "--rows", f"0:{pattern.shape[2]}"))
            assert "attention" not in payload and payload["traced"] is True  # the blocked path
            _close(payload["rows"]["attention"], pattern[0, head], f"{family} long {kind} {layer} head {head}")


def _eager_attentions_encdec(folder, eager, family) -> list[tuple[str, tuple[torch.Tensor, ...]]]:
    """The eager model's three attentions on transformers' own inputs (tests/tiny_encdec.py: the source, or
    Whisper's features from its audio, and the target): (kind, output_attentions) for encoder, decoder, cross."""
    from tiny_encdec import source_and_target

    with torch.no_grad():
        out = eager(**source_and_target(ENCODER_DECODERS[family], folder, eager), output_attentions=True)
    return [("encoder", out.encoder_attentions), ("decoder", out.decoder_attentions),
            ("cross", out.cross_attentions)]


def _encdec_args(family, folder, kind: str, *more: str) -> list[str]:
    from tiny_encdec import SOURCE, TARGET

    source = ["--audio", str(folder / "speech.wav")] if family == "Whisper" else ["--text", SOURCE]
    return [*source, "--target", TARGET, "--attention", kind, *more]


def _generate_encoder_decoder(runner, folder, eager, family):
    """Each decoder layer's self- and cross-attention row at every step, and the new tokens, against transformers'
    `generate` from the same decoder ids (forced_eos_token_id off: BART's config forces </s> as the last token,
    and attnscope decodes plainly), Whisper's against its eager forward a step at a time (its generate() forces and
    suppresses tokens)."""
    from tiny_encdec import greedy, source_and_target

    inputs = source_and_target(ENCODER_DECODERS[family], folder, eager)
    if family == "Whisper":
        ids, decoder, cross = greedy(eager, inputs, NEW_TOKENS)
    else:
        from transformers import DynamicCache, EncoderDecoderCache

        # a cache of our own: generate's would size itself by num_layers, the encoder's 2, not T5's 3 decoder layers
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        with torch.no_grad():
            out = eager.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                 forced_eos_token_id=None, output_attentions=True, return_dict_in_generate=True,
                                 **{cache_keyword(eager): cache})  # past_key_values before transformers 5.2x
        n = inputs["decoder_input_ids"].shape[1]
        ids, decoder, cross = out.sequences[0, n:].tolist(), out.decoder_attentions, out.cross_attentions
    for kind, theirs in (("decoder", decoder), ("cross", cross)):
        for layer in range(len(theirs[0])):
            payload = _json(runner, folder, *_encdec_args(family, folder, kind, "--layer", str(layer), "--generate",
                                                          str(NEW_TOKENS)))
            assert payload["target_token_ids"] == inputs["decoder_input_ids"][0].tolist()
            steps = payload["decode_steps"]
            assert [s["token_id"] for s in steps] == ids, f"{family}: other tokens"
            for t, step in enumerate(steps):
                _close(step["attention"], theirs[t][layer][0, :, -1], f"{family} generate {kind} {layer} step {t}")


def _generate(runner, folder, eager, family, monkeypatch):
    if family in ENCODER_DECODERS:
        _generate_encoder_decoder(runner, folder, eager, family)
        return
    for index, layer in enumerate(attention_layers(eager)):  # output_attentions' entries: attention layers only
        payload = _json(runner, folder, "--text", PROMPT, "--layer", str(layer), "--generate", str(NEW_TOKENS))
        ids = payload["token_ids"]
        steps = payload["decode_steps"]
        with torch.no_grad():
            out = eager.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, output_attentions=True, return_dict_in_generate=True)
        assert [s["token_id"] for s in steps] == out.sequences[0, len(ids):].tolist(), f"{family}: other tokens"
        for t, step in enumerate(steps):
            entries = out.attentions[t]  # MiniMax's: every layer's (its lightning layers' states too)
            every = len(entries) == eager.config.get_text_config().num_hidden_layers
            theirs = entries[layer if every else index][0, :, -1]  # [n_head, keys the cache holds]
            mine = torch.tensor(step["attention"])[:, -theirs.shape[-1]:]
            _close(mine, theirs, f"{family} generate layer {layer} step {t}")


def _all_layers_encoder_decoder(runner, folder, eager, family):
    """Each of the three attentions, every layer of its stack, against transformers' eager output_attentions."""
    for kind, theirs in _eager_attentions_encdec(folder, eager, family):
        payload = _json(runner, folder, *_encdec_args(family, folder, kind, "--all-layers"))
        assert [entry["layer"] for entry in payload["all_layers"]] == list(range(len(theirs)))
        for layer, entry in enumerate(payload["all_layers"]):
            _close(entry["attention"], theirs[layer][0], f"{family} all-layers {kind} layer {layer}")


def _all_layers(runner, folder, eager, family, monkeypatch):
    if family in ENCODER_DECODERS:
        _all_layers_encoder_decoder(runner, folder, eager, family)
        return
    layers = attention_layers(eager)
    payload = _json(runner, folder, "--text", SENTENCE, "--all-layers", "--layer", str(layers[0]))
    theirs = eager_attentions(eager, payload["token_ids"])
    shown = payload["all_layers"]
    if row_of(family).views is LINEAR_HYBRID:  # every layer, the linear ones as their exact matrix M
        assert [entry["layer"] for entry in shown] == list(range(eager.config.num_hidden_layers))
        shown = [entry for entry in shown if entry["layer"] in layers]
    assert len(shown) == len(theirs) == len(layers)  # a hybrid's attention layers, in order
    assert [entry["layer"] for entry in shown] == layers  # numbered as the model numbers them
    for layer, entry in enumerate(shown):
        _close(entry["attention"], theirs[layer], f"{family} all-layers layer {layer}")


def _check(runner, folder, eager, family, monkeypatch):
    """--check at run time: every layer PASSes against transformers' eager run, and a decoder's generated ids and
    rows too."""
    if family in ENCODER_DECODERS:
        _check_encoder_decoder(runner, folder, eager, family)
        return
    layer = attention_layers(eager)[-1]
    decodes = row_of(family).views["generate"] == EXACT
    more = ["--generate", "3"] if decodes else []
    payload = _json(runner, folder, "--text", PROMPT if decodes else SENTENCE, "--all-layers", "--layer", str(layer),
                    "--check", *more)
    assert payload["check_passed"] is True, payload["check"]
    names = [c["name"] for c in payload["check"]]
    assert [n for n in names if n.startswith("layer ")] == [f"layer {i}" for i in attention_layers(eager)]
    if decodes:
        assert "generated ids" in names and sum(n.startswith("step ") for n in names) == 3


def _check_encoder_decoder(runner, folder, eager, family):
    """Each attention's every layer PASSes; the decoder's and the cross-attention's with --generate, the new ids and
    each step's row too."""
    for kind in ("encoder", "decoder", "cross"):
        more = ["--generate", "3"] if kind != "encoder" else []
        payload = _json(runner, folder, *_encdec_args(family, folder, kind, "--all-layers", "--layer", "1", "--check",
                                                      *more))
        assert payload["check_passed"] is True, payload["check"]
        names = [c["name"] for c in payload["check"]]
        n_layer = len(payload["all_layers"])
        assert [n for n in names if " layer " in n and not n.startswith("step")] == [
            f"{kind} layer {i}" for i in range(n_layer)]
        if more:
            assert "generated ids" in names and sum(n.startswith("step ") for n in names) == 3


@pytest.mark.parametrize("family", [row.family for row in ROWS])
def test_watch_cell(family, built):
    """The watch column (tests/watch_conformance.py): every row watched, as conformance.watch_column says."""
    from watch_conformance import cell

    folder, eager = built(family)
    row = row_of(family)
    decodes = row.views["generate"] == EXACT and ":" not in family or family.startswith(("interface:", "hybrid:"))
    cell(family, folder, eager, ENCODER_DECODERS.get(family), decodes)


def row_of(family: str):
    return next(r for r in ROWS if r.family == family)


def _refused(runner, folder, family, view, monkeypatch):
    from attnscope.models.forward import long

    args = {"short": ["--text", SENTENCE], "long": ["--text", SENTENCE], "generate": ["--text", PROMPT, "--generate",
            "2"], "all-layers": ["--text", SENTENCE, "--all-layers"], "check": ["--text", SENTENCE, "--check"]}[view]
    if view == "long":
        monkeypatch.setattr(long, "LONG_TOKENS", 8)
    if family in ENCODER_DECODERS:
        args = [*_source(family, folder), *args[2:]]
    result = runner.invoke(app, ["head", "--model", str(folder), *args])
    assert result.exit_code == 2, f"{family} {view}: exit {result.exit_code}\n{result.output}"
    assert "Traceback" not in result.stderr and "--debug" not in result.stderr, result.stderr
