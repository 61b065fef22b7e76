"""GGUF files (issue 32) on tiny models: every family llama.cpp writes that attnscope reads (LLaMA with its rotary
reorder, Qwen 2 and 3, Gemma 2 and 3, Phi-3), quantized Q8_0 and Q4_0, against transformers' own GGUF loader
(`from_pretrained(..., gguf_file=...)`, eager `output_attentions`, `generate`, AutoTokenizer's ids); the header
against the gguf package's GGUFReader; split files, a folder, Ollama's store; the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tiny_gguf
import torch

from attnscope.cli import app

TEXT = "The cat sat on the mat. The cat sat on the mat because it was tired."
SCALED = ("llama3", "phi3long")  # RoPE scaling transformers' GGUF loader does not read: against the source model


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """`(family, quant) -> (path, transformers' model, its tokenizer)`, each written and loaded once."""
    made: dict[tuple[str, str], tuple[Path, object, object]] = {}

    def get(family: str, quant: str = "Q8_0"):
        if (family, quant) not in made:
            path = tiny_gguf.write(family, tmp_path_factory.mktemp(f"{family}-{quant}"), quant)
            made[family, quant] = (path, *tiny_gguf.reference(path))
        return made[family, quant]

    return get


def all_layers(runner, path: Path, *extra: str) -> dict:
    result = runner.invoke(app, ["head", "--model", str(path), "--layer", "1", "--head", "1", "--text", TEXT,
                                 "--all-layers", "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("family", [f for f in tiny_gguf.FAMILIES if f not in SCALED])
def test_every_layer_equals_transformers_gguf_loader(written, runner, family, quant):
    path, reference, tokenizer = written(family, quant)
    payload = all_layers(runner, path)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert payload["token_ids"] == ids[0].tolist()  # the tokenizer built from tokenizer.ggml.* gives AutoTokenizer's
    with torch.no_grad():
        eager = reference(ids, output_attentions=True).attentions
    assert len(payload["all_layers"]) == len(eager) == reference.config.num_hidden_layers
    for entry, theirs in zip(payload["all_layers"], eager, strict=True):
        torch.testing.assert_close(torch.tensor(entry["attention"]), theirs[0], atol=1e-5, rtol=0)
    assert any("GGUF: the attention shown is that of the dequantized weights" in note for note in payload["notes"])


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_generate_equals_transformers_generate(written, runner, family):
    path, reference, tokenizer = written(family)
    result = runner.invoke(app, ["head", "--model", str(path), "--layer", "1", "--text", TEXT, "--generate", "4",
                                 "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = reference.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, output_attentions=True,
                                 return_dict_in_generate=True)
    new = out.sequences[0, ids.shape[1]:].tolist()
    assert [step["token_id"] for step in payload["decode_steps"]] == new
    for step, attentions in zip(payload["decode_steps"], out.attentions, strict=True):
        torch.testing.assert_close(torch.tensor(step["attention"]), attentions[1][0, :, -1], atol=1e-5, rtol=0)


def test_head_weights_are_the_reference_rows_with_the_gguf_source(written):
    """LLaMA's W_Q and W_K: llama.cpp's reordered rows put back (transformers' _reverse_permute_weights); the source
    names the GGUF tensor, its type and the reorder."""
    from attnscope import model_head

    path, reference, _ = written("llama", "Q4_0")
    result = model_head(path, layer=1, head=3)
    attention = reference.model.layers[1].self_attn
    d = 16
    torch.testing.assert_close(result.weights.as_torch()["W_Q"], attention.q_proj.weight[3 * d : 4 * d])
    torch.testing.assert_close(result.weights.as_torch()["W_K"], attention.k_proj.weight[1 * d : 2 * d])
    torch.testing.assert_close(result.weights.as_torch()["W_O"], attention.o_proj.weight[:, 3 * d : 4 * d])
    assert result.weights.sources["W_Q"] == "blk.1.attn_q.weight[48:64, :] (Q4_0 -> float32, rotary rows reordered)"
    assert result.weights.sources["W_V"] == "blk.1.attn_v.weight[16:32, :] (Q4_0 -> float32)"


def test_config_is_transformers_config(written):
    """The metadata read as transformers' GGUF loader reads it (load_gguf_checkpoint's config)."""
    from attnscope.models.config import read_config

    for family in ("qwen2", "gemma3", "phi3"):
        path, reference, _ = written(family)
        ours, theirs = read_config(path).data, reference.config
        for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings"):
            assert ours[key] == getattr(theirs, key), (family, key)
        assert ours["rms_norm_eps"] == pytest.approx(theirs.rms_norm_eps)


def test_header_equals_gguf_reader(written):
    """Every metadata value and tensor as the gguf package's own GGUFReader reads them."""
    from gguf import GGUFReader

    from attnscope.models.gguf.header import Strings, read_header

    path, _, _ = written("qwen3", "Q4_0")
    ours, theirs = read_header(path), GGUFReader(path)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.metadata) == set(fields)
    assert isinstance(ours.metadata["tokenizer.ggml.tokens"], Strings)  # a vocabulary is read only for a text
    for key, value in fields.items():
        if isinstance(ours.metadata[key], Strings):
            ours.metadata[key] = ours.metadata[key].values()
        assert ours.metadata[key] == pytest.approx(value) if isinstance(value, float) else ours.metadata[key] == value
    assert ours.data_start == theirs.data_offset
    for tensor in theirs.tensors:
        info = ours.tensors[tensor.name]
        assert (info.start, info.nbytes) == (tensor.data_offset, tensor.n_bytes)
        assert info.ggml_type == int(tensor.tensor_type)
        assert list(info.shape) == list(reversed(tensor.shape.tolist()))


def test_split_file_folder_and_ollama_read_the_same(written, runner, tmp_path, monkeypatch):
    """A split model (gguf-split's -0000k-of-0000n shards, any one named), a folder holding the file, and
    ollama:NAME:TAG (its manifest's model blob, read where it lies) give the single file's run."""
    import hashlib

    path, _, _ = written("qwen2")
    single = all_layers(runner, path)["all_layers"]
    split = tmp_path / "split"
    split.mkdir()
    tiny_gguf.write_split(path, split / "tiny.gguf", 3)
    shards = sorted(split.iterdir())
    assert [p.name for p in shards] == [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(path, folder / "model.gguf")
    store = tmp_path / "ollama"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    (store / "blobs").mkdir(parents=True)
    shutil.copy(path, store / "blobs" / f"sha256-{digest}")
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "q8"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": f"sha256:{digest}"}]}))
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    for model in (shards[1], folder, "ollama:tiny:q8"):
        assert all_layers(runner, model)["all_layers"] == single, model
    result = runner.invoke(app, ["head", "--model", "ollama:tiny", "--text", TEXT])
    assert result.exit_code == 2 and "ollama pull tiny" in result.stderr
    (split / shards[2].name).unlink()
    result = runner.invoke(app, ["head", "--model", str(shards[0]), "--text", TEXT])
    assert result.exit_code == 2 and "shard 3" in result.stderr


def test_anatomy_reads_the_metadata(written, runner):
    path, _, _ = written("gemma3")
    result = runner.invoke(app, ["anatomy", str(path), "--json"])
    assert result.exit_code == 0, result.output
    layers = json.loads(result.stdout)["layers"]
    assert [layer["kind"] for layer in layers] == ["sliding"] * 5 + ["full"]
    assert layers[0]["window"] == 4 and layers[5]["rope"]["base"] == 1_000_000.0 and layers[0]["head_dim"] == 256
    import gguf

    found = json.loads(result.stdout)
    context = gguf.GGUFReader(str(path)).get_field("gemma3.context_length")
    assert found["tokens_from"] == "the GGUF's context_length"  # no config.json field: the file's own key
    assert found["tokens"] == int(context.parts[context.data[0]][0])


def test_refusals(written, runner, tmp_path):
    """One line, exit 2: no tokenizer for --text, an unknown architecture, a type attnscope cannot dequantize."""
    import gguf
    import numpy as np

    bare = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(bare), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 32), ("attention.head_count", 2)):
        writer.add_uint32(f"llama.{key}", value)
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        writer.add_tensor(f"blk.0.{name}.weight", np.ones((32, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = runner.invoke(app, ["head", "--model", str(bare), "--text", "hi"])
    assert result.exit_code == 2 and "holds no tokenizer" in result.stderr, result.output
    assert runner.invoke(app, ["head", "--model", str(bare)]).exit_code == 0  # the weights alone need no tokenizer

    mamba = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(mamba), "mamba")
    writer.add_tensor("x.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = runner.invoke(app, ["head", "--model", str(mamba)])
    assert result.exit_code == 2 and "architecture 'mamba'" in result.stderr and "qwen3" in result.stderr
    assert result.stderr.count("\n") == 1


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random bytes make some scales inf: NaN equals NaN here
@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                                  "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_rows_of_every_type_are_the_whole_tensor_dequantized(tmp_path, kind):
    """Rows read alone (their bytes only) equal those rows of the whole tensor as GGUFReader + gguf.quants give it,
    for every block layout: 32-value blocks, the K-quants' 256, and unquantized types."""
    import gguf
    import numpy as np

    from attnscope.models.gguf.checkpoint import GgufCheckpoint
    from attnscope.models.gguf.header import read_header

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 12, 512
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    if kind in ("F32", "F16", "BF16"):  # values rather than blocks: finite ones
        dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.float32}[kind]
        values = np.random.default_rng(0).standard_normal((rows, cols)).astype(dtype)
        raw = gguf.quants.quantize(values, qtype).view(np.uint8).reshape(rows, -1) if kind == "BF16" else \
            values.view(np.uint8).reshape(rows, -1)
    path = tmp_path / "one.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("embedding_length", cols), ("attention.head_count", 4)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tensor("blk.0.attn_v.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(path).tensors[0]
    whole = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type).reshape(rows, cols)
    checkpoint = GgufCheckpoint(read_header(path))
    part, text = checkpoint.slice("model.layers.0.self_attn.v_proj.weight", "rows", 5, 9)
    np.testing.assert_array_equal(part, whole[5:9])
    assert text == "[5:9, :]"
    np.testing.assert_array_equal(checkpoint.tensor("model.layers.0.self_attn.v_proj.weight").numpy(), whole)


@pytest.mark.parametrize("family", SCALED)
def test_rope_scaling_llama_cpp_keeps_in_tensors(runner, tmp_path, family):
    """Llama 3.1's RoPE scaling, which llama.cpp's converter writes as a factor per frequency (rope_freqs.weight),
    and Phi-3's longrope (rope_factors_short and _long, the original context, the attention factor), which
    transformers' GGUF loader leaves out: every layer equal to the model the file was converted from (weights kept
    F32, so that model is the exact reference), on a text past Phi-3's original context of 8."""
    from tiny_models import _bpe

    path = tiny_gguf.write(family, tmp_path, "F32")
    payload = all_layers(runner, path)
    vocab, _ = _bpe(True, ["<|endoftext|>"])
    source = tiny_gguf.hf_model(family, len(vocab))
    source.config._attn_implementation = "eager"
    with torch.no_grad():
        eager = source(torch.tensor([payload["token_ids"]]), output_attentions=True).attentions
    for entry, theirs in zip(payload["all_layers"], eager, strict=True):
        torch.testing.assert_close(torch.tensor(entry["attention"]), theirs[0], atol=1e-5, rtol=0)
    unscaled, _ = tiny_gguf.reference(path)  # transformers' GGUF route: the scaling lost, the pattern not the same
    with torch.no_grad():
        lost = unscaled(torch.tensor([payload["token_ids"]]), output_attentions=True).attentions
    assert (lost[1][0] - eager[1][0]).abs().max() > 1e-3


def test_a_split_of_its_own_goes_through_transformers_converter(tmp_path):
    """tokenizer.ggml.pre "qwen2" (Qwen's split regex): built by transformers' convert_gguf_tokenizer, the ids
    AutoTokenizer's on text where the split matters (digits, contractions, runs of spaces and punctuation)."""
    from transformers import AutoTokenizer

    from attnscope.models import tokenizer

    path = tiny_gguf.write("qwen2", tmp_path, pre="qwen2")
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ("It's 12345 cats!!  and\n\tdogs...", "The cat sat on the mat.", " <|endoftext|>x"):
        encoded = tokenizer.encode(path, text)
        assert encoded.ids == reference(text).input_ids, text
        assert encoded.tokens == reference.convert_ids_to_tokens(encoded.ids)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_sentencepiece_vocabulary_goes_through_transformers_converter(tmp_path, arch):
    """tokenizer.ggml.model "llama" (LLaMA 2's and Gemma's SentencePiece pieces): the ids, BOS included (llama.cpp
    adds it unless the file says not), AutoTokenizer's."""
    from transformers import AutoTokenizer

    from attnscope.models import tokenizer

    path = tiny_gguf.write_sentencepiece(arch, tmp_path)
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ("The cat sat on the mat.", "  two spaces", "Attention is all"):
        encoded = tokenizer.encode(path, text)
        assert encoded.ids == reference(text).input_ids, text
        assert encoded.tokens == reference.convert_ids_to_tokens(encoded.ids)
