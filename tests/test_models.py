"""Every family attnscope reads, against transformers' own models: a tiny random model of each, saved with
save_pretrained. The dumped slices equal the model's parameters; the --text pattern equals eager
output_attentions for every (layer, head); the traced layer's output equals the attention module's own; the
tokenizer gives AutoTokenizer's ids."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tiny_models import FAMILIES, SENTENCE, assert_every_head_dumped, base, build, cached_builder

from attnscope.cli import app
from attnscope.models.config import read_config
from attnscope.models.families import open_model
from attnscope.models.tokenizer import encode
from attnscope.models.weights import head_weights
from attnscope.runs.head import HeadOptions, run_head

WINDOW = 4  # the sliding window of the tiny Mistral, Qwen2 and Gemma 2


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (folder, eager model), each built the first time a test asks for it."""
    return cached_builder(tmp_path_factory, build, shard=lambda family: family == "llama")


@pytest.fixture(scope="module")
def eager(built):
    """family -> (input ids, attentions, attention modules' outputs per layer) on SENTENCE, from transformers."""
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            from transformers import AutoTokenizer

            folder, model = built(family)
            encoded = AutoTokenizer.from_pretrained(folder)(SENTENCE, return_tensors="pt")
            outputs: dict[int, torch.Tensor] = {}

            def keep(layer: int):
                def hook(module, args, out) -> None:  # returns None: the output stays as it is
                    outputs[layer] = out[0] if isinstance(out, tuple) else out
                return hook

            hooks = [module.register_forward_hook(keep(layer))
                     for layer, module in enumerate(_output_projections(family, model))]
            with torch.no_grad():
                attentions = model(**encoded, output_attentions=True).attentions
            for hook in hooks:
                hook.remove()
            cache[family] = encoded["input_ids"][0].tolist(), attentions, outputs
        return cache[family]

    return get


def _output_projections(family: str, model) -> list:
    """The modules whose output is attnscope's step `x`: the attention after its output projection."""
    inner = base(model)
    if family in ("bert", "roberta"):
        return [layer.attention.output.dense for layer in inner.encoder.layer]
    if family == "gpt2":
        return [block.attn for block in inner.h]
    return [layer.self_attn for layer in inner.layers]


def _expected_slices(family: str, model, layer: int, head: int) -> dict[str, torch.Tensor]:
    """Head h's weights read off transformers' modules, in attnscope's orientation ([d_head, d_model])."""
    inner = base(model)
    if family in ("bert", "roberta"):
        attention = inner.encoder.layer[layer].attention
        d = attention.self.query.weight.shape[0] // model.config.num_attention_heads
        rows = slice(head * d, (head + 1) * d)
        return {"W_Q": attention.self.query.weight[rows], "W_K": attention.self.key.weight[rows],
                "W_V": attention.self.value.weight[rows], "b_Q": attention.self.query.bias[rows],
                "b_K": attention.self.key.bias[rows], "b_V": attention.self.value.bias[rows],
                "W_O": attention.output.dense.weight[:, rows]}
    if family == "gpt2":
        attn = inner.h[layer].attn
        D, d = attn.embed_dim, attn.head_dim
        cols = [slice(part * D + head * d, part * D + (head + 1) * d) for part in range(3)]
        return {"W_Q": attn.c_attn.weight[:, cols[0]].T, "W_K": attn.c_attn.weight[:, cols[1]].T,
                "W_V": attn.c_attn.weight[:, cols[2]].T, "b_Q": attn.c_attn.bias[cols[0]],
                "b_K": attn.c_attn.bias[cols[1]], "b_V": attn.c_attn.bias[cols[2]],
                "W_O": attn.c_proj.weight[head * d : (head + 1) * d].T}
    attn = inner.layers[layer].self_attn
    d, group = attn.head_dim, attn.num_key_value_groups
    q, kv = slice(head * d, (head + 1) * d), slice(head // group * d, (head // group + 1) * d)
    expected = {"W_Q": attn.q_proj.weight[q], "W_K": attn.k_proj.weight[kv], "W_V": attn.v_proj.weight[kv]}
    if attn.q_proj.bias is not None:
        expected |= {"b_Q": attn.q_proj.bias[q], "b_K": attn.k_proj.bias[kv], "b_V": attn.v_proj.bias[kv]}
    return expected | {"W_O": attn.o_proj.weight[:, q]}


def _open(folder: Path):
    return open_model(folder, read_config(folder))


# --- weights ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_dumped_slices_equal_the_models_parameters(built, family):
    folder, model = built(family)
    assert_every_head_dumped(folder, lambda layer, head: _expected_slices(family, model, layer, head), family)


@pytest.mark.parametrize(("family", "prefix", "sources"), [
    ("llama", "model.", {"W_Q": "model.layers.1.self_attn.q_proj.weight[24:32, :]",
                         "W_K": "model.layers.1.self_attn.k_proj.weight[8:16, :]",
                         "b_V": "model.layers.1.self_attn.v_proj.bias[8:16]",
                         "W_O": "model.layers.1.self_attn.o_proj.weight[:, 24:32]"}),
    ("mistral", "", {"W_K": "layers.1.self_attn.k_proj.weight[8:16, :]"}),
    ("qwen2", "model.", {"b_Q": "model.layers.1.self_attn.q_proj.bias[24:32]"}),
    ("gemma2", "model.", {"W_Q": "model.layers.1.self_attn.q_proj.weight[48:64, :]",
                          "W_O": "model.layers.1.self_attn.o_proj.weight[:, 48:64]"}),
    ("gpt2", "transformer.", {"W_Q": "transformer.h.1.attn.c_attn.weight[:, 18:24].T",
                              "W_V": "transformer.h.1.attn.c_attn.weight[:, 66:72].T",
                              "b_K": "transformer.h.1.attn.c_attn.bias[42:48]",
                              "W_O": "transformer.h.1.attn.c_proj.weight[18:24, :].T"}),
    ("roberta", "roberta.", {"W_O": "roberta.encoder.layer.1.attention.output.dense.weight[:, 18:24]"}),
])
def test_sources_name_key_and_slice(built, family, prefix, sources):
    folder, _ = built(family)
    opened = _open(folder)
    assert opened.prefix == prefix
    weights = head_weights(opened, 1, 3)
    assert {name: weights.sources[name] for name in sources} == sources
    assert opened.checkpoint.sharded == (family == "llama")


def test_gqa_note_names_the_query_heads_that_share_a_kv_head(built):
    weights = head_weights(_open(built("llama")[0]), 0, 3)
    assert weights.notes == ["W_K, W_V: KV head 1 of 2 (= 3 // n_group 2) serves query heads 2, 3"]


# --- the pattern on a sentence ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_text_pattern_and_output_equal_eager_for_every_head(built, eager, family):
    folder, _ = built(family)
    ids, attentions, outputs = eager(family)
    for layer, per_layer in enumerate(attentions):
        for head in range(per_layer.shape[1]):
            result = run_head(HeadOptions(model=str(folder), layer=layer, head=head, text=SENTENCE))
            assert result.encoded.ids == ids
            torch.testing.assert_close(result.attention, per_layer[0, head], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result.run.layer["x"], outputs[layer], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("family", "layer", "windowed"), [("mistral", 1, True), ("qwen2", 0, False),
                                                          ("qwen2", 2, True), ("gemma2", 0, True),
                                                          ("gemma2", 1, False)])
def test_sliding_window_layers_on_a_text_longer_than_the_window(built, family, layer, windowed):
    folder, _ = built(family)
    result = run_head(HeadOptions(model=str(folder), layer=layer, head=1, text=SENTENCE))
    n = result.attention.shape[0]
    assert n > 2 * WINDOW
    far = torch.ones(n, n, dtype=torch.bool).tril(-WINDOW)  # key j with i - j >= window
    assert bool((result.attention[far] == 0).all()) == windowed
    assert result.run.spec.window == (WINDOW if windowed else None)
    assert (f"window({WINDOW}" in result.run.layer.step("masked_scores").op) == windowed


def test_gqa_head_reads_the_shared_kv_head(built):
    result = run_head(HeadOptions(model=str(built("llama")[0]), layer=2, head=3, text=SENTENCE))
    layer, head = result.run.layer, result.run.head
    torch.testing.assert_close(head["K_rot"], layer["K_rot"][0, 1])  # KV head 1 = 3 // 2
    torch.testing.assert_close(head["K_rot"], layer["K_rep"][0, 3])
    assert [s.name for s in layer.steps][:13] == ["X", "Q_feat", "K_feat", "V_feat", "Q_split", "K_split", "V_split",
                                                 "cos", "sin", "Q_rot", "K_rot", "K_rep", "V_rep"]
    assert layer.step("K_split").dims == ("n_batch", "n_kv_head", "n_tokens", "d_head")
    assert layer.step("X").dims == ("n_batch", "n_tokens", "d_model")
    assert head.step("K").op == "K_split[0, 1] = X @ W_K.T + b_K" and head.step("Q").op.startswith("Q_split[0, 3]")


@pytest.mark.parametrize(("family", "names"), [
    ("bert", ["X", "Q", "K", "V", "scores", "attention", "out", "value_norms", "weighted"]),
    ("gpt2", ["X", "Q", "K", "V", "scores", "masked_scores", "attention", "out", "value_norms", "weighted"]),
    ("gemma2", ["X", "Q", "K", "V", "Q_rot", "K_rot", "scores", "capped_scores", "masked_scores", "attention",
                "out", "value_norms", "weighted"]),
])
def test_head_steps_are_the_heads_slice_of_the_computation(built, family, names):
    result = run_head(HeadOptions(model=str(built(family)[0]), layer=1, head=2, text=SENTENCE))
    head = result.run.head
    assert [s.name for s in head.steps] == names
    torch.testing.assert_close(head["out"], head["attention"] @ head["V"])
    assert head.step("attention").dims == ("n_tokens", "n_tokens")


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_gives_autotokenizers_ids(built, family):
    from transformers import AutoTokenizer

    folder, _ = built(family)
    reference = AutoTokenizer.from_pretrained(folder)
    for text in (SENTENCE, "  the  cat\tsat ", "Café naïve — ☕ 日本", "the cat</s><s>[SEP] sat"):
        ours = encode(folder, text)
        ids = reference(text)["input_ids"]
        assert ours.ids == ids, text
        assert ours.tokens == reference.convert_ids_to_tokens(ids)
        assert ours.via == "tokenizers"


# --- the command -----------------------------------------------------------------------------------------


def test_cli_json_keeps_the_bert_contract_and_adds_the_layer(runner, built, tmp_path):
    folder, _ = built("qwen2")
    target = tmp_path / "run.safetensors"
    result = runner.invoke(app, ["head", "--model", str(folder), "--layer", "2", "--head", "1", "--text", SENTENCE,
                                 "--json", "--save", str(target)])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["command"] == "head" and payload["traced"] is True
    assert [t["name"] for t in payload["tensors"]] == ["W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "W_O"]
    assert payload["model"]["kv_heads"] == 2 and payload["model"]["model_type"] == "qwen2"
    n = len(payload["tokens"])
    assert len(payload["attention"]) == n and len(payload["token_ids"]) == n
    assert [s["name"] for s in payload["steps"]][:4] == ["X", "Q", "K", "V"]
    assert "K_rep" in [s["name"] for s in payload["layer_steps"]]
    assert payload["layer_attention"]["window"] == WINDOW and payload["layer_attention"]["kv_head"] == 0
    from safetensors.torch import load_file

    saved = load_file(target)
    assert {"W_Q", "W_O", "X", "Q", "attention", "out", "layer.X", "layer.Q_feat", "layer.attention", "layer.x"} \
        <= set(saved)
    assert saved["attention"].shape == (n, n) and saved["layer.attention"].shape == (1, 4, n, n)
    torch.testing.assert_close(saved["attention"], torch.tensor(payload["attention"]))


def test_bert_text_save_holds_every_step_shown(runner, built, tmp_path):
    """issue 9: bert --text --save held the weights and attention only."""
    folder, _ = built("bert")
    target = tmp_path / "bert.safetensors"
    result = runner.invoke(app, ["bert", "--model", str(folder), "--layer", "1", "--head", "0", "--text", SENTENCE,
                                 "--save", str(target)])
    assert result.exit_code == 0, result.output
    from safetensors import safe_open

    with safe_open(str(target), "pt") as handle:
        names = set(handle.keys())
        metadata = json.loads(handle.metadata()["attnscope"])
    assert {"X", "Q", "K", "V", "scores", "attention", "out", "W_Q", "b_Q", "W_O"} <= names
    assert {f"layer.{s}" for s in ("X", "Q_feat", "Q_split", "scores", "attention", "x_raw", "x")} <= names
    assert metadata["steps"]["layer.scores"]["dims"] == ["n_batch", "n_head", "n_tokens", "n_tokens"]
    assert metadata["tokens"][0] == "[CLS]"
    assert f"saved {len(names)} tensors" in result.stdout


@pytest.mark.parametrize("width", [80, 100])
def test_weight_table_fits_and_never_breaks_a_slice(built, width):
    from rich.console import Console

    from attnscope.render.model import show_head

    for family in ("bert", "llama", "gpt2", "gemma2"):
        result = run_head(HeadOptions(model=str(built(family)[0]), layer=2, head=3))
        console = Console(width=width, record=True, no_color=True, file=open("/dev/null", "w"))  # noqa: SIM115
        show_head(console, result)
        lines = console.export_text().splitlines()
        assert max(len(line) for line in lines) <= width
        for source in result.weights.sources.values():
            cut = source.index("[")
            assert any(source[cut:] in line and line.strip().endswith(source[cut:]) for line in lines), source
            assert source in "".join(line.strip() for line in lines)


def test_gpt2_and_gemma2_say_what_is_unusual(runner, built):
    gpt2 = runner.invoke(app, ["head", "--model", str(built("gpt2")[0]), "--layer", "1", "--head", "0"])
    assert "Conv1D stored [in, out]" in gpt2.stdout
    gemma = runner.invoke(app, ["head", "--model", str(built("gemma2")[0]), "--layer", "0", "--head", "0", "--text",
                                SENTENCE])
    assert gemma.exit_code == 0, gemma.output
    assert "d_head is config.json's head_dim, not d_model / heads = 6" in gemma.stdout
    assert "softcap 5" in gemma.stdout and "sliding window 4" in gemma.stdout and "capped_scores" in gemma.stdout


def test_dump_of_a_sharded_llama_imports_neither_torch_nor_transformers(built):
    import subprocess
    import sys

    folder, _ = built("llama")
    code = (f"import sys; from attnscope.cli import main; sys.argv = ['attnscope', 'head', '--model', {str(folder)!r},"
            " '--layer', '2', '--head', '3', '--json']\ntry:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('LOADED', sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}), "
            "file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "LOADED []" in result.stderr, result.stderr
    assert json.loads(result.stdout)["tensors"][1]["source"] == "model.layers.2.self_attn.k_proj.weight[8:16, :]"


def test_bfloat16_checkpoint_runs_in_float32(built, tmp_path):
    """Half-precision weights are upcast: the pattern equals eager's on the same weights loaded as float32."""
    import shutil

    from transformers import AutoTokenizer, LlamaForCausalLM

    folder, model = built("llama")
    half = tmp_path / "bf16"
    model.to(torch.bfloat16).save_pretrained(half)
    model.to(torch.float32)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, half / name)
    reference = LlamaForCausalLM.from_pretrained(half, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = reference(**AutoTokenizer.from_pretrained(half)(SENTENCE, return_tensors="pt"),
                             output_attentions=True).attentions[2][0, 1]
    result = run_head(HeadOptions(model=str(half), layer=2, head=1, text=SENTENCE))
    assert result.weights.tensors["W_Q"].dtype == torch.bfloat16
    assert result.run.layer.step("X").dtype == "float32"
    torch.testing.assert_close(result.attention, expected, atol=1e-5, rtol=1e-5)


def test_head_help_is_instant_and_ends_with_examples():
    import subprocess
    import sys

    code = ("import sys; from attnscope.cli import main; sys.argv = ['attnscope', 'head', '--help']\ntry:\n"
            "    main()\nexcept SystemExit:\n    pass\nprint('LOADED', sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'transformers'}), file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, "COLUMNS": "100"})
    assert "LOADED []" in result.stderr, result.stderr
    assert "attnscope head --model ./llama-dir --layer 3 --head 17" in result.stdout


def test_sharded_pytorch_bin_checkpoint(built, eager, tmp_path):
    """pytorch_model.bin.index.json and its shards (older large checkpoints): memory-mapped, never unpickled code."""
    import shutil

    folder, model = built("qwen2")
    old = tmp_path / "bin"
    old.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, old / name)
    state = model.state_dict()
    shards = {key: f"pytorch_model-0000{1 + ('layers.2.' in key)}-of-00002.bin" for key in state}
    for shard in sorted(set(shards.values())):
        torch.save({k: v.contiguous() for k, v in state.items() if shards[k] == shard}, old / shard)
    (old / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": shards}))
    _, attentions, _ = eager("qwen2")
    result = run_head(HeadOptions(model=str(old), layer=2, head=3, text=SENTENCE))
    torch.testing.assert_close(result.attention, attentions[2][0, 3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.weights.as_torch()["b_K"], _expected_slices("qwen2", model, 2, 3)["b_K"].detach())


@pytest.mark.parametrize(("edit", "windows"), [
    (lambda c: {k: v for k, v in c.items() if k != "layer_types"}, [None, WINDOW, WINDOW]),  # max_window_layers 1
    (lambda c: {k: v for k, v in c.items() if k != "layer_types"} | {"max_window_layers": 2}, [None, None, WINDOW]),
    (lambda c: c | {"use_sliding_window": False}, [None, None, None]),
])
def test_qwen2_windows_from_older_configs(built, tmp_path, edit, windows):
    """Configs saved before layer_types existed: Qwen2Config's rule (sliding from max_window_layers on, and only
    with use_sliding_window)."""
    import shutil

    folder = tmp_path / "qwen2"
    shutil.copytree(built("qwen2")[0], folder)
    config = folder / "config.json"
    config.write_text(json.dumps(edit(json.loads(config.read_text()))))
    opened = _open(folder)
    assert [opened.attention_spec(layer).window for layer in range(3)] == windows
    from transformers import Qwen2Config  # Qwen2Attention: sliding_window where layer_types says sliding

    theirs = Qwen2Config.from_pretrained(folder)
    assert [theirs.sliding_window if kind == "sliding_attention" else None for kind in theirs.layer_types] == windows


# --- every head of a layer (--all-heads) ---------------------------------------------------------------------


def plain_stats(pattern: list[list[float]]) -> dict[str, float]:
    """A head's statistics by their definitions (docs/heads.md), in plain float64 Python, for a square pattern
    whose query i sits at position i."""
    n = len(pattern)
    rows = range(n)
    return {
        "entropy": sum(-sum(p * math.log2(p) for p in row if p > 0) for row in pattern) / n,
        "first": sum(row[0] for row in pattern) / n,
        "previous": sum(pattern[i][i - 1] for i in rows if i >= 1) / (n - 1),
        "self": sum(pattern[i][i] for i in rows) / n,
        "distance": sum(sum(p * abs(i - j) for j, p in enumerate(pattern[i])) for i in rows) / n,
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_all_heads_json_equals_eager_for_every_head(runner, built, eager, family):
    """--all-heads: every head's pattern is transformers' eager output_attentions to 1e-5, and its statistics
    are the definitions' on that pattern."""
    folder, _ = built(family)
    _, attentions, _ = eager(family)
    layer = len(attentions) - 1
    result = runner.invoke(app, ["head", "--model", str(folder), "--layer", str(layer), "--head", "1", "--text",
                                 SENTENCE, "--all-heads", "--json"])
    assert result.exit_code == 0, result.output
    heads = json.loads(result.stdout)["heads"]
    expected = attentions[layer][0]  # [n_head, n_tokens, n_tokens]
    assert [h["head"] for h in heads] == list(range(expected.shape[0]))
    for h, entry in enumerate(heads):
        assert set(entry) == {"head", "attention", "stats", "kind", "kind_also", "value_norms", "weighted", "moved",
                              "sinks_share"}
        torch.testing.assert_close(torch.tensor(entry["attention"], dtype=torch.float32), expected[h],
                                   atol=1e-5, rtol=1e-5)
        reference = plain_stats(expected[h].double().tolist())
        for key, value in reference.items():
            assert entry["stats"][key] == pytest.approx(value, abs=1e-5), (h, key)
        assert entry["kind"] in ("first-token", "previous-token", "self", "broad", "local", "mixed")
