"""Bad input to `attnscope head` and `attnscope bert`: each gets one line on stderr and the right exit status,
never a traceback; and a family attnscope has no page for still shows its attention through transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import SENTENCE, build

from attnscope.cli import app


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    build("llama", folder)
    return folder


@pytest.fixture(scope="module")
def opt(tmp_path_factory) -> tuple[Path, object]:
    """A family attnscope does not read (OPT), with GPT-2's tokenizer class."""
    from tiny_models import _tokenizer
    from transformers import OPTConfig, OPTModel

    folder = tmp_path_factory.mktemp("opt")
    tokenizer = _tokenizer("gpt2")
    config = OPTConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=2, ffn_dim=32,
                       num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=16)
    torch.manual_seed(0)
    OPTModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, OPTModel.from_pretrained(folder, attn_implementation="eager").eval()


def _variant(source: Path, tmp_path: Path, edit=None, drop: tuple[str, ...] = ()) -> Path:
    """A copy of a model folder with config.json edited (`edit(config) -> new config`) and files dropped."""
    folder = tmp_path / "variant"
    shutil.copytree(source, folder)
    for name in drop:
        (folder / name).unlink()
    if edit is not None:
        path = folder / "config.json"
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    return folder


def _fails(runner, args: list[str], code: int, *phrases: str) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == code, (result.exit_code, result.output)
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and line.startswith("attnscope: error: "), line
    assert "Traceback" not in result.output and "--debug for the traceback" not in line, line
    for phrase in phrases:
        assert phrase in line, line
    return line


@pytest.mark.parametrize(("args", "phrase"), [
    (["--layer", "3"], "--layer 3 is out of range: this model has 3 layers, 0 to 2"),
    (["--head", "4"], "--head 4 is out of range: this model has 4 heads, 0 to 3"),
    (["--text", "  "], "--text is empty"),
    (["--text", "caf\udce9 au lait"], "--text is not valid UTF-8"),
    (["--text", SENTENCE, "--max-memory", "1KB"], "more than --max-memory"),
])
def test_out_of_range_empty_or_undecodable(runner, llama, args, phrase):
    code = 1 if "--max-memory" in args else 2
    _fails(runner, ["head", "--model", str(llama), *args], code, phrase)


@pytest.mark.parametrize(("edit", "phrase"), [
    (lambda c: {k: v for k, v in c.items() if k != "num_attention_heads"}, "num_attention_heads is missing"),
    (lambda c: c | {"num_attention_heads": "4"}, "num_attention_heads is '4' (str); it must be a whole number"),
    (lambda c: c | {"num_attention_heads": 0}, "num_attention_heads is 0; it must be at least 1"),
    (lambda c: c | {"hidden_size": True}, "hidden_size is True"),
    (lambda c: [c], "holds a JSON list, not an object"),
    (lambda c: c | {"num_key_value_heads": 3}, "4 attention heads are not a multiple of 3 key/value heads"),
    (lambda c: c | {"num_hidden_layers": 5}, "says 5 layers but model.safetensors holds 3"),
    (lambda c: c | {"layer_types": "sliding"}, None),  # llama ignores layer_types: not an error
])
def test_malformed_config(runner, llama, tmp_path, edit, phrase):
    folder = _variant(llama, tmp_path, edit)
    if phrase is None:
        assert runner.invoke(app, ["head", "--model", str(folder)]).exit_code == 0
        return
    _fails(runner, ["head", "--model", str(folder)], 2, phrase)


def test_config_not_json(runner, llama, tmp_path):
    folder = _variant(llama, tmp_path)
    (folder / "config.json").write_text("{not json")
    _fails(runner, ["head", "--model", str(folder)], 2, "not readable JSON")


def test_text_without_a_tokenizer_is_refused_naming_the_files(runner, llama, tmp_path):
    folder = _variant(llama, tmp_path, drop=("tokenizer.json", "tokenizer_config.json"))
    assert runner.invoke(app, ["head", "--model", str(folder)]).exit_code == 0  # the weights need no tokenizer
    _fails(runner, ["head", "--model", str(folder), "--text", SENTENCE], 2, "has no tokenizer for --text",
           "tokenizer.json", "vocab.txt", "tokenizer.save_pretrained")


@pytest.mark.parametrize(("vocab", "said"), [(b"\x00\x01garbage\n\xff", "valid UTF-8"),
                                             (b"abc\ndef\n", "Missing [UNK]")])
def test_a_garbage_vocabulary_is_one_line_naming_the_file(runner, tmp_path, vocab, said):
    """The tokenizers library raises a plain Exception for a vocab.txt it cannot read or encode with."""
    folder = tmp_path / "bert"
    build("bert", folder)
    (folder / "tokenizer.json").unlink()
    (folder / "vocab.txt").write_bytes(vocab)
    _fails(runner, ["head", "--model", str(folder), "--text", SENTENCE], 2, f"--model {folder}: no usable tokenizer",
           "vocab.txt cannot be read", said)


def test_unsupported_rope_scaling_is_refused_by_name_for_text_only(runner, llama, tmp_path):
    folder = _variant(llama, tmp_path, lambda c: c | {"rope_parameters": {"rope_type": "axial",
                                                                         "rope_theta": 10000.0}})
    assert runner.invoke(app, ["head", "--model", str(folder)]).exit_code == 0
    _fails(runner, ["head", "--model", str(folder), "--text", SENTENCE], 2, "RoPE type 'axial'",
           "is not one attnscope computes")


def test_unknown_activation_is_named(runner, llama, tmp_path):
    folder = _variant(llama, tmp_path, lambda c: c | {"hidden_act": "mish"})
    _fails(runner, ["head", "--model", str(folder), "--layer", "1", "--text", SENTENCE], 2, "activation 'mish'")


def test_missing_shard_and_incomplete_checkpoint(runner, tmp_path):
    sharded = tmp_path / "sharded"
    build("llama", sharded, shard=True)
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shard.unlink()
    _fails(runner, ["head", "--model", str(sharded)], 2, f"names shard {shard.name}, which is not in")


def test_bert_refuses_other_layouts_and_points_to_head(runner, llama):
    _fails(runner, ["bert", "--model", str(llama)], 2, "LlamaForCausalLM (model_type 'llama')",
           "attnscope bert supports BERT-layout", "use attnscope head")


def test_text_longer_than_learned_positions(runner, tmp_path):
    folder = tmp_path / "gpt2"
    build("gpt2", folder)
    _fails(runner, ["head", "--model", str(folder), "--text", "the cat " * 40], 2,
           "more than this model's 64 positions")


def test_nan_weights_never_reach_json_as_nan(runner, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bert"
    build("bert", folder)
    weights = load_file(folder / "model.safetensors")
    weights["encoder.layer.0.attention.self.query.weight"][0, 0] = float("nan")
    save_file(weights, folder / "model.safetensors")
    result = runner.invoke(app, ["bert", "--model", str(folder), "--json"])
    assert result.exit_code == 0, result.output
    assert "NaN" not in result.stdout
    w_q = json.loads(result.stdout)["tensors"][0]
    assert w_q["stats"]["mean"] is None and w_q["stats"]["norm"] is None
    assert "nan" in runner.invoke(app, ["bert", "--model", str(folder)]).stdout


def test_unsupported_family_dump_names_type_and_families(runner, opt):
    folder, _ = opt
    _fails(runner, ["head", "--model", str(folder)], 2, "OPTModel (model_type 'opt')",
           "bert, roberta, gpt2, llama, mistral, qwen2, gemma2", "--text")


def test_unsupported_family_text_is_traced_through_transformers(runner, opt):
    from transformers import AutoTokenizer

    folder, model = opt
    result = runner.invoke(app, ["head", "--model", str(folder), "--layer", "1", "--head", "1", "--text", SENTENCE,
                                 "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["traced"] is True and payload["tracer"] == "attention-interface" and payload["tensors"] == []
    assert [s["name"] for s in payload["steps"]][:3] == ["Q", "K", "V"]
    assert "not one attnscope has a page for" in payload["notes"][0]
    encoded = AutoTokenizer.from_pretrained(folder)(SENTENCE, return_tensors="pt")
    with torch.no_grad():
        expected = model(**encoded, output_attentions=True).attentions[1][0, 1]
    torch.testing.assert_close(torch.tensor(payload["attention"]), expected, atol=1e-5, rtol=1e-5)
    table = runner.invoke(app, ["head", "--model", str(folder), "--layer", "1", "--head", "1", "--text", SENTENCE])
    assert "note: model_type 'opt' is not one attnscope has a page for" in " ".join(table.stdout.split())
    every = runner.invoke(app, ["head", "--model", str(folder), "--layer", "1", "--text", SENTENCE, "--all-heads",
                                "--json"])
    heads = json.loads(every.stdout)["heads"]  # --all-heads through transformers too: its own patterns
    assert len(heads) == model.config.num_attention_heads
    with torch.no_grad():
        layer = model(**encoded, output_attentions=True).attentions[1][0]
    for h, entry in enumerate(heads):
        torch.testing.assert_close(torch.tensor(entry["attention"]), layer[h], atol=1e-5, rtol=1e-5)
    _fails(runner, ["head", "--model", str(folder), "--layer", "2", "--text", SENTENCE], 2,
           "--layer 2 is out of range: this model has 2 layers")
