"""Encoder-decoders (T5, UMT5, BART, Marian, mBART, Whisper): every layer of the three attentions and every head
against transformers' eager `encoder_attentions`, `decoder_attentions` and `cross_attentions`, the layer's output
against the family's own attention module, T5's buckets and bias against `T5Attention`, where head h lives
against the modules' parameters, and the command line (--json, --all-heads, --save, bad input)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_encdec import ENCDEC, SOURCE, TARGET, build, source_and_target, write_wav

from attnscope.models.nopage.cache_names import cache_keyword, cache_of

KINDS = {"encoder": "encoder_attentions", "decoder": "decoder_attentions", "cross": "cross_attentions"}


@pytest.fixture(scope="module", params=ENCDEC)
def family(request, tmp_path_factory):
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    model = build(name, folder)
    with torch.no_grad():
        out = model(**source_and_target(name, folder, model), output_attentions=True)
    return name, folder, model, out


def _run(family, kind, layer, head, **more):
    from attnscope.runs.head import HeadOptions, run_head

    name, folder, _, _ = family
    source = {"audio": str(folder / "speech.wav")} if name == "whisper" else {"text": SOURCE}
    return run_head(HeadOptions(model=str(folder), layer=layer, head=head, target=TARGET, attention=kind,
                                **source, **more))


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_layer_and_head_equals_eager(family, kind):
    _, _, _, out = family
    expected = getattr(out, KINDS[kind])
    for layer in range(len(expected)):
        n_head = expected[layer].shape[1]
        head = (layer + 1) % n_head
        result = _run(family, kind, layer, head)
        assert result.tracer == "attnscope" and result.kind == kind
        torch.testing.assert_close(result.all_heads, expected[layer][0], atol=1e-5, rtol=0)  # every head
        torch.testing.assert_close(result.attention, expected[layer][0, head], atol=1e-5, rtol=0)
        rows, cols = result.axes()
        assert (len(rows), len(cols)) == tuple(expected[layer].shape[-2:])


def _module(model, name, kind, layer):
    """transformers' own attention module of this kind and layer."""
    base = model.model if hasattr(model, "model") else model
    if name in ("t5", "umt5"):
        stack = base.encoder if kind == "encoder" else base.decoder
        block = stack.block[layer].layer
        return block[1].EncDecAttention if kind == "cross" else block[0].SelfAttention
    stack = base.encoder if kind == "encoder" else base.decoder
    return stack.layers[layer].encoder_attn if kind == "cross" else stack.layers[layer].self_attn


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_layer_output_equals_the_familys_attention_module(family, kind):
    """Our X (and memory) through transformers' module: its output equals the traced `x`."""
    name, _, model, _ = family
    layer = 1
    result = _run(family, kind, layer, 0)
    trace = result.run.layer
    module = _module(model, name, kind, layer)
    memory = {"umt5": "encoder_hidden_states"}.get(name, "key_value_states")  # UMT5Attention's own word
    kwargs = {memory: trace["memory"]} if kind == "cross" else {}
    if name == "t5" and kind != "cross":
        kwargs["position_bias"] = trace["position_bias"]  # UMT5Attention computes its own, from its own table
    if kind == "decoder":
        n = trace["X"].shape[1]
        kwargs["mask" if name == "t5" else "attention_mask"] = torch.full((n, n), float("-inf")).triu(1)
    with torch.no_grad():
        x = module(trace["X"], **kwargs)[0]
    torch.testing.assert_close(trace["x"], x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_heads_weights_are_the_modules_slices(family, kind):
    name, _, model, _ = family
    from attnscope.models.config import read_config
    from attnscope.models.families import open_model
    from attnscope.models.weights import head_weights

    folder = family[1]
    view = open_model(folder, read_config(folder)).for_kind(kind)
    module = _module(model, name, kind, 1)
    t5 = name in ("t5", "umt5")
    q, k, v, o = ((module.q, module.k, module.v, module.o) if t5 else
                  (module.q_proj, module.k_proj, module.v_proj, module.out_proj))
    d = view.d_head
    for head in range(view.n_head):
        weights = head_weights(view, 1, head).as_torch()
        rows = slice(head * d, (head + 1) * d)
        torch.testing.assert_close(weights["W_Q"], q.weight[rows])
        torch.testing.assert_close(weights["W_K"], k.weight[rows])
        torch.testing.assert_close(weights["W_V"], v.weight[rows])
        torch.testing.assert_close(weights["W_O"], o.weight[:, rows])
        if not t5:
            torch.testing.assert_close(weights["b_Q"], q.bias[rows])
            assert ("b_K" in weights) == (name != "whisper")


def test_t5s_buckets_and_bias_are_t5attentions(tmp_path):
    """The encoder's bidirectional and the decoder's causal buckets, and the bias they index, against
    `T5Attention._relative_position_bucket` and `compute_bias` (layer 0's table, shared)."""
    from attnscope.models.families.t5 import relative_buckets

    model = build("t5", tmp_path / "t5")
    result = None
    for kind, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
        from attnscope.runs.head import HeadOptions, run_head

        result = run_head(HeadOptions(model=str(tmp_path / "t5"), layer=1, head=0, text=SOURCE, target=TARGET,
                                      attention=kind))
        trace = result.run.layer
        n = trace["X"].shape[1]
        attention = stack.block[0].layer[0].SelfAttention
        with torch.no_grad():
            torch.testing.assert_close(trace["position_bias"], attention.compute_bias(n, n))
        relative = torch.arange(n)[None, :] - torch.arange(n)[:, None]
        expected = attention._relative_position_bucket(relative, bidirectional=kind == "encoder", num_buckets=8,
                                                       max_distance=12)
        assert torch.equal(trace["position_buckets"], expected)
        assert "layer 0's, shared by every layer" in trace.step("position_bias").op
        assert trace.step("scores").op.endswith("* 1")
    for n_Q, n_K, bidirectional in ((3, 40, True), (40, 40, False), (7, 200, True)):
        relative = torch.arange(n_K)[None, :] - torch.arange(n_Q)[:, None]
        from transformers.models.t5.modeling_t5 import T5Attention

        assert torch.equal(relative_buckets(n_Q, n_K, bidirectional, 32, 128),
                           T5Attention._relative_position_bucket(relative, bidirectional, 32, 128))
    assert any("does not scale the scores" in note for note in result.notes)


def test_the_head_steps_name_source_and_target_apart(family):
    result = _run(family, "cross", 0, 1)
    layer, head = result.run.layer, result.run.head
    assert layer.step("X").dims == ("n_batch", "n_Q", "d_model")
    assert layer.step("memory").dims == ("n_batch", "n_K", "d_model")
    assert layer.step("K_feat").op == "W_k(memory)"
    assert layer.step("attention").dims == ("n_batch", "n_head", "n_Q", "n_K")
    assert [s.name for s in head.steps][:3] == ["X", "memory", "Q"]
    assert head.step("K").op.endswith("= memory @ W_K.T" + (" + b_K" if family[0] not in ("t5", "umt5") else ""))
    torch.testing.assert_close(head["attention"], layer["attention"][0, 1])
    encoder = _run(family, "encoder", 0, 1).run.layer
    assert encoder.step("attention").dims == ("n_batch", "n_head", "n_tokens", "n_tokens")


def test_the_target_defaults_to_the_decoders_start_token(family):
    """Through the Python API (`attnscope.model_head`), as a notebook calls it."""
    from attnscope import model_head

    name, folder, model, _ = family
    source = {"audio": folder / "speech.wav"} if name == "whisper" else {"text": SOURCE}
    result = model_head(folder, 0, 0, attention="cross", **source)
    assert result.target.ids == [model.config.decoder_start_token_id]
    assert result.attention.shape[0] == 1 and abs(float(result.attention.sum()) - 1) < 1e-5


def test_json_save_and_all_heads(family, runner, tmp_path):
    from attnscope.cli import app
    from attnscope.tensors import load_tensor

    name, folder, _, out = family
    source = ["--audio", str(folder / "speech.wav")] if name == "whisper" else ["--text", SOURCE]
    saved = tmp_path / "cross.safetensors"
    result = runner.invoke(app, ["head", "--model", str(folder), *source, "--target", TARGET, "--attention", "cross",
                                 "--layer", "1", "--head", "2", "--all-heads", "--json", "--save", str(saved)])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["attention_kind"] == "cross" and payload["tracer"] == "attnscope" and payload["traced"]
    assert payload["params"]["target"] == TARGET and payload["params"]["attention"] == "cross"
    expected = out.cross_attentions[1][0]
    assert len(payload["target_tokens"]) == len(payload["target_token_ids"]) == expected.shape[1]
    assert len(payload["tokens"]) == expected.shape[2]
    np.testing.assert_allclose(payload["attention"], expected[2].numpy(), atol=1e-5)
    assert [h["head"] for h in payload["heads"]] == list(range(expected.shape[0]))
    np.testing.assert_allclose(payload["heads"][3]["attention"], expected[3].numpy(), atol=1e-5)
    assert payload["model"]["encoder_layers"] == 2 and payload["model"]["decoder_layers"] == 3
    assert {"X", "memory", "Q", "K", "attention"} <= {s["name"] for s in payload["steps"]}
    torch.testing.assert_close(load_tensor(f"{saved}:layer.memory"), _run(family, "cross", 1, 2).run.layer["memory"])


def test_the_table_reads_at_80_columns(family, runner):
    from attnscope.cli import app

    name, folder, _, _ = family
    source = ["--audio", str(folder / "speech.wav")] if name == "whisper" else ["--text", SOURCE]
    result = runner.invoke(app, ["head", "--model", str(folder), *source, "--target", TARGET, "--attention", "cross",
                                 "--layer", "0"], env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    assert "cross layer 0's attention, every head, on " in result.stdout
    assert "the decoder's cross-attention: queries from the target tokens (n_Q)" in result.stdout


def test_a_weight_dump_needs_no_text(tmp_path, runner):
    from attnscope.cli import app

    build("bart", tmp_path / "bart")
    result = runner.invoke(app, ["head", "--model", str(tmp_path / "bart"), "--attention", "cross", "--layer", "2",
                                 "--head", "3", "--json"])
    assert result.exit_code == 0, result.output
    sources = {t["name"]: t["source"] for t in json.loads(result.stdout)["tensors"]}
    # the decoder's 6 heads of 24 // 6 = 4 (the encoder's are 4 of 6): cross-attention's heads are the decoder's
    assert sources["W_K"] == "model.decoder.layers.2.encoder_attn.k_proj.weight[12:16, :]"
    assert sources["W_O"] == "model.decoder.layers.2.encoder_attn.out_proj.weight[:, 12:16]"


@pytest.fixture(scope="module")
def whisper_and_bart(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    build("whisper", root / "whisper")
    build("bart", root / "bart")
    return root


@pytest.mark.parametrize(("args", "line"), [
    (["bart", "--target", "x", "--attention", "cross"], "--target needs the source the decoder attends to: add --text"),
    (["bart", "--text", "a", "--audio", "x.wav"], "--audio is Whisper's source; model_type 'bart' reads text: "
                                                  "give --text"),
    (["whisper", "--text", "a"], "Whisper's encoder reads audio, not text: give --audio FILE (a .wav) for the "
                                 "source, and --target \"...\" for the text its decoder reads"),
    (["whisper", "--audio", "missing.wav"], "--audio missing.wav: no such file"),
    (["whisper", "--audio", "speech.mp3"], "--audio speech.mp3: attnscope reads PCM .wav files only; convert it "
                                           "first, e.g. ffmpeg -i speech.mp3 -ac 1 -ar 16000 -c:a pcm_s16le "
                                           "speech.wav"),
    (["whisper", "--audio", "fast.wav"], "--audio fast.wav is sampled at 8000 Hz but this Whisper's feature "
                                         "extractor takes 16000 Hz; resample it, e.g. ffmpeg -i fast.wav -ar 16000 "
                                         "fast-16000.wav"),
    (["whisper", "--audio", "float.wav"], "--audio float.wav: not a PCM WAV file (unknown format: 3); convert it "
                                          "first, e.g. ffmpeg -i float.wav -ac 1 -ar 16000 -c:a pcm_s16le "
                                          "float-pcm16.wav"),
    (["bart", "--layer", "3", "--attention", "decoder"], "--layer 3 is out of range: this model has 3 layers, 0 to 2"),
    (["whisper", "--audio", "cut.wav"], "--audio cut.wav is truncated: its data chunk holds 1 of the 320 bytes it "
                                        "declares; give the whole file"),  # the fuzz's find: was a ValueError
    (["whisper", "--audio", "long-fmt.wav"], "--audio long-fmt.wav: not a PCM WAV file (a chunk runs past the end of "
                                             "the file); convert it first, e.g. ffmpeg -i long-fmt.wav -ac 1 -ar 16000 "
                                             "-c:a pcm_s16le long-fmt-pcm16.wav"),  # wave's bare RuntimeError
    (["whisper", "--all-layers"], "--all-layers run the model on an input; add --audio"),
    (["bart", "--generate", "2", "--attention", "decoder"], "--generate run the model on an input; add --text"),
    (["whisper", "--audio", "whisper/speech.wav", "--generate", "2"], "--generate decodes the target, and the "
     "encoder does not decode: add --attention decoder (the new tokens' self-attention) or --attention cross (their "
     "attention over the source)"),
    (["bart", "--text", "a", "--attention", "cross", "--generate", "5000"], "--generate 5000: give how many new "
     "tokens to decode, 1 to 4096"),
    (["whisper", "--audio", "whisper/speech.wav", "--attention", "cross", "--generate", "30"], "--generate 30: the "
     "decoder reads 1 token and would reach 31 positions, more than this model's 24; give --generate 23 or fewer"),
    (["whisper", "--audio", "whisper/speech.wav", "--attention", "cross", "--rows", "0:1"], "--rows picks exact query "
     "rows of a pattern that is pooled, and Whisper's source is always 50 positions and its target at most 24 tokens, "
     "at most 2,048: its patterns are never pooled; drop --rows"),
    (["bart", "--text", "a", "--rows", "1-2"], "--rows 1-2: give query rows as A:B with 0 <= A < B, e.g. --rows "
                                              "100:110"),
])
def test_bad_input_is_one_line(whisper_and_bart, runner, monkeypatch, args, line):
    from attnscope.cli import app

    monkeypatch.chdir(whisper_and_bart)
    (whisper_and_bart / "speech.mp3").write_bytes(b"ID3")
    write_wav(whisper_and_bart / "fast.wav", rate=8000)
    _write_float_wav(whisper_and_bart / "float.wav")
    (whisper_and_bart / "cut.wav").write_bytes(  # a data chunk of 320 bytes declared, 1 there
        b"RIFFd\x01\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00\x80>\x00\x00\x00}\x00\x00\x02\x00\x10\x00"
        b"data@\x01\x00\x00\x00")
    (whisper_and_bart / "long-fmt.wav").write_bytes(  # a fmt chunk of 272 bytes declared in a 44-byte file
        b"RIFF$\x00\x00\x00WAVEfmt \x10\x01\x00\x00\x01\x00\x01\x00\x80>\x00\x00\x80>\x00\x00\x01\x00\x08\x00"
        b"data\x00\x00\x00\x00")
    result = runner.invoke(app, ["head", "--model", args[0], *args[1:]])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"attnscope: error: {line}"]


def _write_float_wav(path):
    """A 32-bit float WAV (format 3), which the wave module refuses: 0.1 s of a tone at 16 kHz."""
    import struct

    data = (0.1 * np.sin(np.arange(1600) / 10)).astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, 16000, 16000 * 4, 4, 32)
    path.write_bytes(b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE" + b"fmt "
                     + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)


def test_whisper_without_its_feature_extractor_says_what_is_missing(whisper_and_bart, runner, tmp_path):
    import shutil

    from attnscope.cli import app

    folder = tmp_path / "whisper"
    shutil.copytree(whisper_and_bart / "whisper", folder)
    (folder / "preprocessor_config.json").unlink()
    result = runner.invoke(app, ["head", "--model", str(folder), "--audio", str(folder / "speech.wav")])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"attnscope: error: --model {folder} has no preprocessor_config.json: Whisper's "
                                    "feature extractor (mel bins, sampling rate, hop) is unknown")


@pytest.mark.parametrize("kind", ["cross", "encoder"])
def test_one_stack_models_refuse_encoder_decoder_options(runner, tmp_path, kind):
    """--attention encoder too: it was accepted silently where decoder and cross were refused."""
    from tiny_models import build as build_decoder

    from attnscope.cli import app

    build_decoder("gpt2", tmp_path / "gpt2")
    result = runner.invoke(app, ["head", "--model", str(tmp_path / "gpt2"), "--text", "a", "--attention", kind])
    assert result.exit_code == 2
    assert "--attention reads an encoder-decoder (T5, BART, Marian, mBART, Whisper); GPT2LMHeadModel" in result.stderr


@pytest.mark.parametrize(("channels", "width"), [(1, 1), (2, 2), (1, 3), (1, 4)])
def test_wav_samples_are_read_as_numpy_reads_them(tmp_path, channels, width):
    from attnscope.models.audio import read_wav

    path = write_wav(tmp_path / "a.wav", seconds=0.01, channels=channels, width=width)
    samples, rate = read_wav(path)
    assert rate == 16000 and samples.shape == (160,)
    t = np.arange(160) / 16000
    expected = 0.5 * np.sin(2 * np.pi * (100 + 300 * t) * t)
    np.testing.assert_allclose(samples, expected, atol=2 / 2 ** (8 * width - 1) + 1e-6)


@pytest.mark.parametrize("kind", list(KINDS))
def test_all_layers_are_every_layer_of_the_stack_labelled_as_it_reads(family, kind):
    """--all-layers: one forward through the stacks, each layer's pattern of the attention asked equal to eager's,
    the rows and columns the target's and the source's tokens as that attention reads them."""
    _, _, _, out = family
    expected = getattr(out, KINDS[kind])
    result = _run(family, kind, 1, 0, all_layers=True)
    assert result.layer_numbers == list(range(len(expected)))
    rows, cols = result.axes()
    for layer, heads in enumerate(result.layer_heads):
        torch.testing.assert_close(heads.attention, expected[layer][0], atol=1e-5, rtol=0)
        assert (heads.row_labels, heads.col_labels) == (rows, cols)
    torch.testing.assert_close(result.all_heads, expected[1][0], atol=1e-5, rtol=0)  # layer L traced as without it


@pytest.mark.parametrize("kind", ["decoder", "cross"])
def test_generate_holds_what_transformers_cache_holds(family, kind):
    """Each step's row and token against transformers' forward a step at a time, and the KV cache's bytes against
    its EncoderDecoderCache after the same step (the self-attention's keys and values, and memory's projected
    once for the cross-attention)."""
    from tiny_encdec import greedy

    name, folder, model, _ = family
    n_new = 4
    inputs = source_and_target(name, folder, model)
    ids, decoder, cross = greedy(model, inputs, n_new)
    result = _run(family, kind, 2, 0, generate=n_new)
    assert [step.token_id for step in result.decode] == ids
    assert [step.position for step in result.decode] == [inputs["decoder_input_ids"].shape[1] + t for t in range(n_new)]
    theirs = decoder if kind == "decoder" else cross
    held = []
    with torch.no_grad():
        out = model(**inputs, use_cache=True)
        for token in ids:
            cache = cache_of(out)
            held.append(sum(t.numel() * t.element_size() for part in (cache.self_attention_cache,
                                                                      cache.cross_attention_cache)
                            for layer in part.layers for t in (layer.keys, layer.values)))
            out = model(encoder_outputs=(out.encoder_last_hidden_state,), **{cache_keyword(model): cache},
                        decoder_input_ids=torch.tensor([[token]]), use_cache=True)
    for t, step in enumerate(result.decode):
        torch.testing.assert_close(step.attention, theirs[t][2][0, :, -1], atol=1e-5, rtol=0)
        assert step.kv_cache_bytes == held[t] and step.evicted == 0


def test_check_fails_on_a_planted_mistake(whisper_and_bart, runner, monkeypatch):
    """--check holds the encoder-decoder's run against transformers' own: a scale gone wrong FAILs, exit 1."""
    from attnscope.cli import app
    from attnscope.models.families.seq2seq import EncoderDecoder

    folder = whisper_and_bart / "bart"
    args = ["head", "--model", str(folder), "--text", SOURCE, "--target", TARGET, "--attention", "cross", "--check",
            "--generate", "2", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["check_passed"] is True
    monkeypatch.setattr(EncoderDecoder, "scale", lambda self: 0.5)
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    payload = json.loads(result.stdout)
    assert payload["check_passed"] is False
    assert not next(c for c in payload["check"] if c["name"] == "cross layer 0")["passed"]


def test_all_layers_and_generate_read_at_80_columns(whisper_and_bart, runner):
    from attnscope.cli import app

    result = runner.invoke(app, ["head", "--model", str(whisper_and_bart / "whisper"), "--audio",
                                 str(whisper_and_bart / "whisper" / "speech.wav"), "--attention", "cross",
                                 "--all-layers", "--generate", "3"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "generated 3 tokens greedily" in result.stdout and "layer 2" in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
