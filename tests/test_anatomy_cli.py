"""`attnscope anatomy` at the command line: bad input is one line and exit 2, fuzzed configs never make a
traceback, --json is strict and adds up, torch is never imported, a Hugging Face name is found in the cache, and
no code from the model folder runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_main import INTERNAL, run_main
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from rich.cells import cell_len

from attnscope.anatomy.config import FIELDS

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "configs"
QWEN3 = json.loads((CONFIGS / "Qwen3-0.6B.json").read_text())


def folder_with(tmp_path: Path, config: object, raw: str | None = None) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(raw if raw is not None else json.dumps(config))
    return folder


def one_line(outcome, code: int, *phrases: str) -> str:
    assert outcome.code == code, (outcome.code, outcome.stdout[-500:], outcome.stderr)
    lines = outcome.error_lines
    assert len(lines) == 1 and lines[0].startswith("attnscope: error: "), lines
    assert INTERNAL not in lines[0] and "Traceback" not in outcome.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(("edit", "phrases"), [
    ({"num_hidden_layers": 10**12}, ("num_hidden_layers is 1,000,000,000,000", "at most 100,000")),
    # what the model reader refuses (models/config.py's check_sane), anatomy refuses in its words (issue 36)
    ({"hidden_size": 2**64}, ("hidden_size is 1.84e+19", "no model is that wide")),
    ({"vocab_size": 1e308}, ("vocab_size is 1e+308", "no vocabulary is that large")),
    ({"intermediate_size": 1e308}, ("intermediate_size is 1e+308", "no model is that wide")),
    ({"pad_token_id": 2**64}, ("pad_token_id", "beyond 64-bit integers")),
    ({"head_dim": 0}, ("head_dim is 0", "at least 1")),
    ({"model_type": 123}, ("model_type is 123", "must be a string")),
    ({"text_config": {"model_type": [1]}}, ("text_config.model_type is [1]", "must be a string")),
    ({"extra": json.loads('{"a":' * 65 + "1" + "}" * 65)}, ("nested more than 64 deep",)),
    ({"num_attention_heads": 10**30}, ("num_attention_heads is", "at most")),
    ({"num_attention_heads": "16"}, ("num_attention_heads", "whole number")),
    ({"num_key_value_heads": 5}, ("num_key_value_heads is 5", "does not divide the 16")),
    ({"rope_theta": float("nan")}, ("rope_theta",)),
    ({"rope_scaling": {"rope_type": "wavy", "factor": 2.0}}, ("rope_type 'wavy'", "yarn")),
    ({"rope_scaling": "yarn"}, ("rope_scaling", "must be an object")),
    ({"layer_types": ["full_attention"] * 3}, ("layer_types", "28 strings")),
    ({"layer_types": ["sliding_attention"] * 28}, ("sliding_window is not set",)),
    ({"max_position_embeddings": 10**15}, ("max_position_embeddings", "at most")),
    ({"num_attention_heads": None, "n_head": None}, ("names no attention heads",)),
    ({"num_attention_heads": [4, 8]}, ("num_attention_heads as a list ([4, 8])",)),
    ({"num_attention_heads": "x" * 10**6}, ("num_attention_heads is 'xxx", "whole number")),
])
def test_a_bad_setting_is_one_line_naming_it(tmp_path, edit, phrases):
    config = {**QWEN3, **edit}
    raw = json.dumps(config, allow_nan=True)
    one_line(run_main("anatomy", str(folder_with(tmp_path, None, raw))), 2, *phrases)


@pytest.mark.parametrize(("raw", "phrase"), [
    ("{not json", "not readable JSON"),
    ("[" * 200_000 + "]" * 200_000, "nested too deeply"),
    ('{"a": ' * 200_000 + "1" + "}" * 200_000, "nested too deeply"),
    ("[1, 2]", "holds a JSON list"),
    ("\udcff", "not readable JSON"),
])
def test_a_file_that_is_not_a_config_is_one_line(tmp_path, raw, phrase):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_bytes(raw.encode("utf-8", "surrogateescape"))
    one_line(run_main("anatomy", str(folder)), 2, phrase)


def test_missing_and_oversized_configs_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    one_line(run_main("anatomy", str(tmp_path / "empty")), 2, "no config.json there")
    one_line(run_main("anatomy", str(tmp_path / "nowhere")), 2, "no such folder or file")
    one_line(run_main("anatomy", ""), 2, "MODEL is empty")
    big = tmp_path / "big"
    big.mkdir()
    with open(big / "config.json", "wb") as file:
        file.truncate(17 * 1024 * 1024)
    one_line(run_main("anatomy", str(big)), 2, "a config.json is a few kilobytes")


@pytest.mark.parametrize(("args", "phrase"), [
    (["--tokens", "0"], "--tokens"), (["--tokens", str(10**13)], "tokens is"),
    (["--dtype", "float7"], "dtype 'float7'"), (["--json", "--svg", "x.svg"], "--svg"),
])
def test_bad_options_are_one_line(tmp_path, args, phrase):
    one_line(run_main("anatomy", str(CONFIGS / "Qwen3-0.6B.json"), *args), 2, phrase)


def test_an_unknown_family_is_read_from_its_fields_and_says_so(tmp_path):
    config = {**QWEN3, "model_type": "my_own_llm", "architectures": ["MyOwnLLM"], "my_attention_trick": 3}
    outcome = run_main("anatomy", str(folder_with(tmp_path, config)), "--json")
    assert outcome.code == 0, outcome.stderr
    data = outcome.json()
    assert data["notes"][0].startswith("model_type 'my_own_llm' is not a family transformers knows")
    assert "my_attention_trick" in data["uninterpreted"]
    assert {layer["kind"] for layer in data["layers"]} == {"full"}
    assert all(layer["qk_norm"] is None for layer in data["layers"])  # Qwen3's qk-norm is not guessed onto it
    text = run_main("anatomy", str(folder_with(tmp_path, config))).stdout
    assert "not interpreted: my_attention_trick" in " ".join(text.split())


def test_json_is_strict_and_adds_up():
    outcome = run_main("anatomy", str(CONFIGS / "gemma-3-1b-it.json"), "--tokens", "2048", "--json")
    assert outcome.code == 0, outcome.stderr
    data = outcome.json()
    for key in ("command", "model", "config", "model_type", "architecture", "part", "tokens", "tokens_from",
                "dtype", "dtype_from", "bytes_per_number", "batch", "layers", "groups", "totals", "notes",
                "uninterpreted"):
        assert key in data, key
    layers = data["layers"]
    assert [layer["index"] for layer in layers] == list(range(26))
    for layer in layers:
        assert {"kind", "n_head", "n_kv_head", "head_dim", "rope", "kv_cache_bytes", "flops_per_token"} <= set(layer)
        expected = 2 * 1 * 256 * (2048 if layer["kind"] == "full" else 511) * 2
        assert layer["kv_cache_bytes"] == expected
    assert data["totals"]["kv_cache_bytes"] == sum(layer["kv_cache_bytes"] for layer in layers)
    assert data["totals"]["flops_per_token"] == sum(layer["flops_per_token"] for layer in layers)
    assert sum(group["count"] for group in data["groups"]) == 26
    assert [group["layers"] for group in data["groups"]] == ["0-4, 6-10, 12-16, 18-22, 24-25", "5,11,...,23"]
    assert sum(group["kv_cache_bytes_total"] for group in data["groups"]) == data["totals"]["kv_cache_bytes"]


def test_no_context_length_asks_for_tokens(tmp_path):
    config = {"model_type": "t5", "d_model": 32, "d_kv": 8, "num_heads": 4, "num_layers": 2,
              "is_encoder_decoder": True}
    outcome = run_main("anatomy", str(folder_with(tmp_path, config)), "--json")
    data = outcome.json()
    assert data["tokens"] is None and data["totals"]["kv_cache_bytes"] is None
    assert any("give --tokens N" in note for note in data["notes"])
    assert run_main("anatomy", str(folder_with(tmp_path, config)), "--tokens", "7").code == 0


@pytest.mark.parametrize("name", ["DeepSeek-V3.json", "gpt-oss-20b.json", "gemma-3-1b-it.json"])
def test_tables_fit_80_columns(name):
    outcome = run_main("anatomy", str(CONFIGS / name))
    assert outcome.code == 0
    assert max(cell_len(line) for line in outcome.stdout.splitlines()) <= 80


def test_a_hub_name_is_found_in_the_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(QWEN3))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    outcome = run_main("anatomy", "org/tiny", "--json")
    assert outcome.code == 0, outcome.stderr
    assert outcome.json()["config"] == str(snapshot / "config.json")
    line = one_line(run_main("anatomy", "org/absent", env={"HF_HUB_OFFLINE": "1"}), 1, "org/absent is not in the")
    assert "--model" not in line


def test_never_torch_never_the_model_folders_code(tmp_path):
    """As a user's shell runs it, with -X importtime: neither torch nor transformers is imported, and a
    config that names its own code (auto_map) does not get it run."""
    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "config.json").write_text((CONFIGS / "DeepSeek-V3.json").read_text())
    (folder / "configuration_deepseek.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "attnscope", "anatomy", str(folder)],
                            capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(ROOT),
                                                                               "NO_COLOR": "1", "COLUMNS": "80"})
    assert result.returncode == 0, result.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert not {name for name in imported if name.split(".")[0] in ("torch", "transformers")}
    assert not (tmp_path / "ran").exists()
    assert "MLA" in result.stdout


# --- fuzzed configs -----------------------------------------------------------------------------------------------

KEYS = sorted(set(FIELDS) | {"model_type", "text_config", "architectures", "rope_parameters", "layer_types",
                             "no_rope_layers", "block_types", "layers_block_type", "attn_config", "encoder",
                             "decoder", "attn_layer_period"})
TYPES = ["qwen3", "qwen2", "gemma2", "gemma3_text", "gemma3", "llama4", "llama4_text", "gpt_oss", "smollm3", "olmo2",
         "phi3", "mistral", "deepseek_v3", "modernbert", "bert", "t5", "bart", "gpt2", "cohere2", "jamba",
         "recurrent_gemma", "falcon", "mpt", "exaone4", "encoder-decoder", "never_heard_of_it"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.integers(-10**40, 10**40),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["full_attention", "sliding_attention", "chunked_attention", "yarn", "default",
                                     "bfloat16", "L", "LLLG", "mamba"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=9),
                                                       st.dictionaries(st.sampled_from(KEYS + ["rope_type", "factor",
                                                                                               "rope_theta"]),
                                                                       inner, max_size=5)), max_leaves=12)
BASES = [json.loads(path.read_text()) for path in sorted(CONFIGS.glob("*.json"))]


@fuzz_settings(60)
@given(base=st.sampled_from(BASES + [{}]), model_type=st.sampled_from(TYPES),
       edits=st.dictionaries(st.sampled_from(KEYS), values, max_size=6), as_json=st.booleans(),
       tokens=st.one_of(st.none(), st.integers(1, 10**6)))
def test_any_config_keeps_the_promises(tmp_path_factory, base, model_type, edits, as_json, tokens):
    folder = tmp_path_factory.mktemp("fuzz")
    config = {**base, "model_type": model_type, **edits}
    (folder / "config.json").write_text(json.dumps(config, allow_nan=True))
    args = ["anatomy", str(folder)] + (["--json"] if as_json else []) + (["--tokens", str(tokens)] if tokens else [])
    outcome = run_main(*args)
    assert outcome.code in (0, 2), (outcome.code, outcome.stderr, config)
    assert INTERNAL not in outcome.stderr and len(outcome.error_lines) <= 1, (outcome.stderr, config)
    if outcome.code == 0 and as_json:
        outcome.json()  # strict: no NaN, no Infinity


def test_a_bad_model_is_named_as_anatomy_takes_it(tmp_path):
    """anatomy's model is its MODEL argument: its messages never name a --model it does not have."""
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUFxxxx")
    for target in (str(path), str(tmp_path / "missing.gguf"), "ollama:nosuch-model"):
        outcome = run_main("anatomy", target)
        assert outcome.code == 2, outcome.stderr
        assert "--model" not in outcome.stderr and "MODEL" in outcome.stderr, outcome.stderr
