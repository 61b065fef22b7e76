"""Beyond one layer (issue 21): every layer against transformers' eager output_attentions, greedy decoding against
transformers' generate (ids, every row, the cache), and a long input's pooled pattern against the exact one."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import build

from attnscope.cli import app
from attnscope.models import tokenizer
from attnscope.models.config import read_config
from attnscope.models.families import open_model
from attnscope.models.nopage.cache_names import cache_of
from attnscope.readings.headstats import RowStats, head_stats, induction_rows

TEXT = "The cat sat on the mat. The cat sat on the mat because it was tired."  # a repeated span: induction


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folders = {}

    def made(family: str):
        if family not in folders:
            folder = tmp_path_factory.mktemp(family)
            folders[family] = (folder, build(family, folder))
        return folders[family]

    return made


@pytest.mark.parametrize("family", ["bert", "roberta", "gpt2", "llama", "mistral", "qwen2", "gemma2"])
def test_every_layer_equals_eager_output_attentions(tiny, runner, family):
    folder, reference = tiny(family)
    result = runner.invoke(app, ["head", "--model", str(folder), "--layer", "1", "--head", "1", "--text", TEXT,
                                 "--all-layers", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    ids = torch.tensor([payload["token_ids"]])
    with torch.no_grad():
        eager = reference(ids, output_attentions=True).attentions  # eager: tiny_models loads it so
    assert [entry["layer"] for entry in payload["all_layers"]] == list(range(len(eager)))
    for entry, theirs in zip(payload["all_layers"], eager, strict=True):
        torch.testing.assert_close(torch.tensor(entry["attention"]), theirs[0], atol=1e-5, rtol=0)
        assert len(entry["kinds"]) == theirs.shape[1] and all("induction" in s for s in entry["stats"])
    # layer L's own view is the same run: its pattern is the all-layers entry
    torch.testing.assert_close(torch.tensor(payload["attention"]), eager[1][0, 1], atol=1e-5, rtol=0)


def test_induction_mass_is_the_weight_on_what_followed_the_earlier_occurrence():
    tokens = [5, 6, 7, 5, 6, 7]  # position 3 repeats 0 (followed by 6 at 1), 4 repeats 1 (7 at 2), 5: 2 (5 at 3)
    A = torch.zeros(6, 6, dtype=torch.float64)
    A[torch.arange(6), torch.arange(6)] = 1.0
    A[3], A[4], A[5] = 0.0, 0.0, 0.0
    A[3, 1] = A[4, 2] = A[5, 3] = 1.0
    rows = induction_rows(A, torch.arange(6), tokens)
    assert rows[:3].isnan().all() and rows[3:].tolist() == [1.0, 1.0, 1.0]
    stats = head_stats(A, tokens=tokens)
    assert stats.induction == 1.0
    from attnscope.readings.headstats import kind

    assert kind(stats) == "induction"
    assert head_stats(A).induction is None and "induction" not in head_stats(A).as_dict()


def test_row_statistics_in_blocks_equal_the_whole():
    torch.manual_seed(0)
    A = torch.softmax(torch.randn(40, 40, dtype=torch.float64).masked_fill(
        ~torch.ones(40, 40, dtype=torch.bool).tril(), float("-inf")), dim=-1)
    tokens = torch.randint(0, 6, (40,)).tolist()
    whole = head_stats(A, tokens=tokens)
    blocks = RowStats()
    for start in range(0, 40, 7):
        blocks.add(A[start : start + 7], start, True, tokens)
    for name, value in blocks.result().as_dict().items():
        assert value == pytest.approx(whole.as_dict()[name], abs=1e-12)


@pytest.mark.parametrize(("family", "layer"), [("llama", 1), ("qwen2", 1), ("qwen2", 0), ("gemma2", 0), ("gpt2", 2)])
def test_generate_equals_transformers_generate(tiny, family, layer):
    """Greedy ids, and each row equal to generate(output_attentions=True)'s last query row of the layer; where a
    sliding window let keys go (Qwen2's layer 1, Gemma 2's layer 0: windows of 4), transformers' row holds only
    the keys its cache kept, and attnscope's the rest as zeros."""
    from attnscope.models.forward.stream import generate

    folder, reference = tiny(family)
    ids = tokenizer.encode(folder, "The cat sat on").ids
    model = open_model(folder, read_config(folder))
    with model.checkpoint:
        steps = generate(model, ids, 6, layer)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 output_attentions=True, return_dict_in_generate=True)
    assert [s.token_id for s in steps] == out.sequences[0, len(ids):].tolist()
    cache = cache_of(out)
    for t, step in enumerate(steps):
        theirs = out.attentions[t][layer][0, :, -1]  # [n_head, keys the cache kept]
        kept = theirs.shape[-1]
        torch.testing.assert_close(step.attention[:, -kept:], theirs, atol=1e-5, rtol=0)
        if t:  # a decode step: the cache holds only what the window keeps (the prompt's row covers every key)
            assert step.evicted == step.attention.shape[-1] - kept
        assert not bool(step.attention[:, : step.evicted].any())
        assert step.position == len(ids) + t
    held = sum(tensor.numel() * tensor.element_size() for layer_cache in cache.layers
               for tensor in (layer_cache.keys, layer_cache.values))
    assert steps[-1].kv_cache_bytes == held


def test_generate_cli(tiny, runner):
    folder, _ = tiny("qwen2")
    result = runner.invoke(app, ["head", "--model", str(folder), "--layer", "1", "--head", "2", "--text",
                                 "The cat sat on", "--generate", "4", "--json"])
    assert result.exit_code == 0, result.output
    steps = json.loads(result.stdout)["decode_steps"]
    assert [len(s["attention"]) for s in steps] == [4] * 4  # every head
    assert [len(s["attention"][0]) for s in steps] == [steps[0]["position"] + i for i in range(4)]
    assert {"token_id", "token", "text", "position", "attention", "evicted", "kv_cache_bytes"} <= set(steps[0])
    table = runner.invoke(app, ["head", "--model", str(folder), "--layer", "1", "--text", "The cat sat on",
                                "--generate", "4"])
    assert table.exit_code == 0 and "generated 4 tokens greedily" in table.stdout and "×" in table.stdout


def test_generate_timeline_numbers_its_keys(tiny, runner):
    """Issue 36, item 10: the terminal timeline had no key labels. A ruler of key positions sits above the
    columns, each number over the column of its key."""
    from attnscope.render.beyond_layer import key_ruler

    folder, _ = tiny("qwen2")
    table = runner.invoke(app, ["head", "--model", str(folder), "--layer", "1", "--text", "The cat sat on the mat",
                                "--generate", "6"], env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    ruler = next(line for line in lines if line.endswith("(key position)"))
    first_row = lines[lines.index(ruler) + 1]  # position, token, then its cells: where the ruler's 0 stands
    assert first_row[ruler.index(" 0 ")] == " " and first_row[:ruler.index(" 0 ")].strip(), (ruler, first_row)
    assert ruler.split()[0] == "0" and max(len(line) for line in lines) <= 80
    assert key_ruler(25, 1, 80) == "0         10        20" and key_ruler(25, 4, 80) == "0         40        80"
    assert key_ruler(25, 1, 30) == "0" + " " * 9 + "10"  # a number that would pass the width is left out


def test_long_input_is_pooled_exactly(tiny, runner, tmp_path):
    """Past LONG_TOKENS the head's pattern is computed in blocks: pooled, it equals transformers' eager pattern
    pooled the same way; its statistics equal the whole pattern's; the rows asked for are exact."""
    from attnscope.models.forward.long import LONG_TOKENS
    from attnscope.views.pooling import pool

    folder, reference = tiny("llama")
    text = tmp_path / "long.txt"
    words = "the cat sat on the mat because it was tired and a dog ran to the park".split()
    generator = torch.Generator().manual_seed(0)
    text.write_text(" ".join(words[int(i)] for i in torch.randint(0, len(words), (LONG_TOKENS,), generator=generator)))
    result = runner.invoke(app, ["head", "--model", str(folder), "--layer", "2", "--head", "3", "--text-file",
                                 str(text), "--rows", "2000:2004", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    n = len(payload["token_ids"])
    assert n > LONG_TOKENS and "attention" not in payload
    r, c = payload["pool"]
    with torch.no_grad():
        exact = reference(torch.tensor([payload["token_ids"]]), output_attentions=True).attentions[2][0, 3]
    expected = pool(exact, r, c)
    torch.testing.assert_close(torch.tensor(payload["attention_pooled"], dtype=torch.float64), expected, atol=1e-6,
                               rtol=0)
    rows = payload["rows"]
    torch.testing.assert_close(torch.tensor(rows["attention"]), exact[2000:2004].double(), atol=1e-5, rtol=0,
                               check_dtype=False)
    whole = head_stats(exact, tokens=payload["token_ids"]).as_dict()
    for name, value in payload["head_stats"].items():
        assert value == pytest.approx(whole[name], abs=1e-4), name


@pytest.mark.parametrize(("args", "says"), [
    (["--rows", "1:3", "--text", "The cat"], "--rows picks exact query rows"),
    (["--generate", "3", "--text", "The cat", "--model-family", "bert"], "causal language model"),
    (["--text", "a", "--text-file", "x.txt"], "keep one"),
    (["--text-file", "missing.txt"], "no such file"),
    (["--generate", "2"], "add --text"),
    (["--rows", "5"], "add --text"),
])
def test_bad_options_are_one_line(tiny, runner, args, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    family = "bert" if "--model-family" in args else "llama"
    args = [a for a in args if a not in ("--model-family", "bert")]
    folder, _ = tiny(family)
    result = runner.invoke(app, ["head", "--model", str(folder), *args])
    assert result.exit_code == 2 and says in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_binary_text_file_is_refused(tiny, runner, tmp_path):
    folder, _ = tiny("llama")
    binary = tmp_path / "b.txt"
    binary.write_bytes(b"\xff\xfe\x00abc")
    result = runner.invoke(app, ["head", "--model", str(folder), "--text-file", str(binary)])
    assert result.exit_code == 2 and "not UTF-8" in result.stderr


@pytest.mark.parametrize(("family", "layer"), [("smollm3", 3), ("phi3", 1)])
def test_generate_of_todays_decoders_equals_transformers(family, layer, tmp_path):
    """SmolLM3's NoPE layer; Phi-3's longrope, whose generate drops the cache and runs the whole text again
    when it first grows past original_max_position_embeddings (8 here: the prompt is 7 tokens)."""
    from tiny_llama4_smollm3_phi3 import build as build_modern

    from attnscope.models.forward.stream import generate

    reference = build_modern(family, tmp_path / family)
    ids = tokenizer.encode(tmp_path / family, "The cat sat on the mat").ids
    model = open_model(tmp_path / family, read_config(tmp_path / family))
    with model.checkpoint:
        steps = generate(model, ids, 6, layer)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 output_attentions=True, return_dict_in_generate=True)
    assert [s.token_id for s in steps] == out.sequences[0, len(ids):].tolist()
    for t, step in enumerate(steps):
        theirs = out.attentions[t][layer][0, :, -1]
        torch.testing.assert_close(step.attention[:, -theirs.shape[-1]:], theirs, atol=1e-5, rtol=0)


def test_a_base_model_refuses_generate_naming_the_flag(tiny, runner):
    """The core's {generate} reads `--generate` on the command line (cli/errors.py FLAGS), not `generate`."""
    folder, _ = tiny("mistral")  # the bare MistralModel: no lm_head.weight
    result = runner.invoke(app, ["head", "--model", str(folder), "--text", "The cat", "--generate", "2"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("attnscope: error: --generate: model.safetensors holds no lm_head.weight")
