"""Model folders attnscope must refuse before it shows anything: a folder asking to run its own code, absurd or
deeply nested config.json, and weights that disagree with their config. Each is one line on stderr, exit 2,
and no prompt, no hang, no traceback (issue 18)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_main import assert_usage_error, run_main, unwrapped
from fuzz_models import EVIL
from tiny_models import SENTENCE, build, with_config


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bert") / "bert"
    build("bert", folder)
    return folder


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gemma2") / "gemma2"
    build("gemma2", folder)
    return folder


def _cli(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The installed command as a shell runs it, stdin a pipe left open (a prompt would wait on it)."""
    command = [sys.executable, "-c", "from attnscope.cli import main; main()", *args]
    env = {**os.environ, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=timeout, env=env)
    result.stderr = unwrapped(result.stderr)  # each message on one line (they wrap at 80 columns)
    return result


# --- a folder's own code never runs, and nothing prompts ------------------------------------------------------


def test_config_auto_map_to_own_code_is_refused_without_a_prompt(bert, tmp_path):
    folder = with_config(bert, tmp_path / "variant", lambda c: c | {
        "model_type": "evilnet", "architectures": ["EvilModel"],
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}})
    (folder / "evil.py").write_text(EVIL)
    # "y" on stdin: today transformers asks "Do you wish to run the custom code? [y/N]" and imports evil.py
    result = _cli("head", "--model", str(folder), "--text", "The cat", "--json", stdin="y\n")
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert not (folder / "RAN").exists()
    assert "custom code" not in result.stdout and result.stdout == ""
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and line.startswith("attnscope: error: "), line
    assert "auto_map" in line and "evil.EvilModel" in line and "never runs code from a model folder" in line


def test_tokenizer_auto_map_to_own_code_is_refused(bert, tmp_path):
    folder = with_config(bert, tmp_path / "variant", lambda c: c | {"tokenizer_class": "EvilTokenizer",
                         "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}, name="tokenizer_config.json")
    (folder / "evil.py").write_text(EVIL)
    outcome = run_main("head", "--model", str(folder), "--text", "The cat")
    assert_usage_error(outcome, "tokenizer_config.json", "auto_map", "evil.EvilTokenizer",
                       "never runs code from a model folder")
    assert not (folder / "RAN").exists()


def test_every_transformers_call_passes_trust_remote_code_false():
    """Every `*.from_pretrained(...)` in attnscope says it, so a prompt cannot come back through a path no test
    drives (transformers prompts only when trust_remote_code is left None)."""
    import ast

    calls = 0
    for path in (Path(__file__).resolve().parents[1] / "attnscope").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "from_pretrained":
                calls += 1
                given = {k.arg: k.value for k in node.keywords}
                value = given.get("trust_remote_code")
                assert isinstance(value, ast.Constant) and value.value is False, (path, node.lineno)
    assert calls >= 2  # the fallback's AutoModel and AutoTokenizer


# --- config.json: absurd sizes and deep nesting, refused from the file alone -----------------------------------


@pytest.mark.parametrize(("edit", "words"), [
    (lambda c: c | {"num_hidden_layers": 10**12}, ["num_hidden_layers is 1,000,000,000,000", "layers"]),
    (lambda c: c | {"num_attention_heads": 10**30}, ["num_attention_heads is 1e+30", "heads"]),
    (lambda c: c | {"hidden_size": 2**40}, ["hidden_size is 1,099,511,627,776", "wide"]),
    (lambda c: c | {"vocab_size": 10**10}, ["vocab_size is 10,000,000,000", "vocabulary"]),
    (lambda c: c | {"num_hidden_layers": 1e15}, ["num_hidden_layers is 1e+15"]),
    (lambda c: c | {"text_config": {"intermediate_size": 10**9}}, ["intermediate_size"]),
    (lambda c: c | {"pad_token_id": 2**64}, ["pad_token_id", "beyond 64-bit integers"]),
])
def test_absurd_config_values_are_refused_before_the_weights_are_read(bert, tmp_path, edit, words):
    folder = with_config(bert, tmp_path / "variant", edit)
    (folder / "model.safetensors").unlink()  # refused from config.json alone: the weights are never looked at
    for command in (["head", "--model", str(folder)], ["head", "--model", str(folder), "--text", "The cat"]):
        assert_usage_error(run_main(*command), "config.json", *words)


def test_absurd_config_values_refused_for_the_transformers_fallback_too(bert, tmp_path):
    folder = with_config(bert, tmp_path / "variant", lambda c: c | {"model_type": "opt", "num_hidden_layers": 10**12})
    assert_usage_error(run_main("head", "--model", str(folder), "--text", "The cat"), "num_hidden_layers")


def test_a_whole_config_of_absurd_layers_does_not_hang(bert, tmp_path):
    folder = with_config(bert, tmp_path / "variant", lambda c: c | {"num_hidden_layers": 10**12})
    result = _cli("head", "--model", str(folder), timeout=60)  # today: a range(10**12) in the size checks
    assert result.returncode == 2 and "num_hidden_layers" in result.stderr, result.stderr


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_json_nested_100000_deep_is_malformed(bert, tmp_path, name):
    folder = with_config(bert, tmp_path / "variant", lambda c: c)
    (folder / name).write_text("[" * 100_000 + "]" * 100_000)
    outcome = run_main("head", "--model", str(folder), "--text", "The cat")
    assert_usage_error(outcome, name, "malformed")


def test_json_nested_past_the_bound_is_malformed(bert, tmp_path):
    nested: dict = {"num_hidden_layers": 3}
    for _ in range(200):
        nested = {"inner": nested}
    folder = with_config(bert, tmp_path / "variant", lambda c: c | {"extra": nested})
    assert_usage_error(run_main("head", "--model", str(folder)), "config.json", "malformed", "nested")


def test_real_configs_pass_the_bounds(bert, gemma2):
    for folder in (bert, gemma2):
        assert run_main("head", "--model", str(folder)).code == 0


# --- weights that disagree with their config -----------------------------------------------------------------


@pytest.mark.parametrize(("edit", "key", "shape", "implied"), [
    # Gemma 2's head_dim decoupled from the width: 16 in the weights, 8 in the config (issue 18's folder)
    (lambda c: c | {"head_dim": 8}, "model.layers.0.self_attn.q_proj.weight", "[64, 24]", "[32, 24]"),
    (lambda c: c | {"num_key_value_heads": 1}, "model.layers.0.self_attn.k_proj.weight", "[32, 24]", "[16, 24]"),
    (lambda c: c | {"hidden_size": 32}, "model.layers.0.self_attn.q_proj.weight", "[64, 24]", "[64, 32]"),
])
def test_weights_that_disagree_with_the_config_are_refused_before_anything_is_shown(gemma2, tmp_path, edit, key,
                                                                                   shape, implied):
    folder = with_config(gemma2, tmp_path / "variant", edit)
    for extra in ([], ["--head", "3"], ["--text", SENTENCE], ["--json"]):
        outcome = run_main("head", "--model", str(folder), *extra)
        assert_usage_error(outcome, key, f"is {shape}", f"implies {implied}", "does not describe these weights")
        assert outcome.stdout == ""


def test_embedding_width_disagreeing_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "gpt2"
    build("gpt2", folder)
    weights = load_file(folder / "model.safetensors")
    weights["transformer.wte.weight"] = torch.zeros(weights["transformer.wte.weight"].shape[0], 20)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    assert_usage_error(run_main("head", "--model", str(folder), "--text", SENTENCE), "transformer.wte.weight",
                       "implies [vocab, 24]")


def test_t5_config_on_bert_weights_with_text_is_one_line(bert, tmp_path):
    folder = with_config(bert, tmp_path / "variant", lambda c: c | {"model_type": "t5", "architectures": ["T5Model"]})
    outcome = run_main("head", "--model", str(folder), "--text", "The cat")
    assert outcome.code in (1, 2), outcome.stderr
    assert len(outcome.error_lines) == 1 and outcome.stderr.startswith("attnscope: error: "), outcome.stderr
    assert "run again with --debug" not in outcome.stderr and "'t5'" in outcome.stderr  # t5's layout, not found
