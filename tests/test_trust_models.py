"""Trust, models (issue 43, items 5, 9, 10, 23, 24): 2026's families' config.json files as a careless or hostile
hand leaves them (one message, exit 2, never an internal error), head kinds a head can hold both of, the rollout
beside its sink token, MiniMax's anatomy against the cache transformers builds, and Gemma 4's full layers against
its eager attention."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_main import INTERNAL, run_main
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

TEXT = "The cat sat on the mat. The cat sat"


# --- item 5: malformed configs -------------------------------------------------------------------------------

def _build(family: str, folder: Path) -> None:
    import tiny_gemma4
    import tiny_indexer
    import tiny_linear
    import tiny_models

    if family in tiny_linear.FAMILIES:
        tiny_linear.build(family, folder)
    elif family == "deepseek_v32":
        tiny_indexer.build(folder, "v32")
    elif family == "deepseek_v3":
        import tiny_deepseek

        tiny_deepseek.build(folder, 3)
    elif family == "llama4":
        import tiny_llama4_smollm3_phi3

        tiny_llama4_smollm3_phi3.build("llama4", folder)
    elif family == "gemma4_text":
        tiny_gemma4.build("gemma4_text", folder)
    else:
        tiny_models.build(family, folder)


FUZZED = ("qwen3_next", "qwen3_5_text", "kimi_linear", "minimax", "deepseek_v32", "deepseek_v3", "gpt_oss",
          "gemma4_text", "llama4")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = tmp_path_factory.mktemp(family)
            _build(family, cache[family])
        return cache[family]

    return get


def _with(folder: Path, target: Path, path: tuple[str, ...], value: object) -> Path:
    """A copy of `folder` (links to its files) whose config.json has `value` at `path` (a key, or a key in one of
    its objects); a list's entry by its index."""
    target.mkdir(parents=True, exist_ok=True)
    for file in folder.iterdir():
        if file.name != "config.json" and not (target / file.name).exists():
            (target / file.name).symlink_to(file)
    data = json.loads((folder / "config.json").read_text())
    held = data
    for key in path[:-1]:
        held = held[int(key)] if isinstance(held, list) else held[key]
    if isinstance(held, list):
        held[int(path[-1])] = value
    else:
        held[path[-1]] = value
    (target / "config.json").write_text(json.dumps(data))
    return target


def _paths(data: object, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key of config.json, of its objects and the entries of its short lists (layer_types' first)."""
    found: list[tuple[str, ...]] = []
    items = (data.items() if isinstance(data, dict)
             else [(str(i), v) for i, v in enumerate(data[:2])] if isinstance(data, list) else [])
    for key, value in items:
        found.append((*prefix, key))
        if isinstance(value, (dict, list)) and len(prefix) < 2:
            found.extend(_paths(value, (*prefix, key)))
    return found


BAD = st.sampled_from([None, "x", "", -1, 0, 1, 3, -(2 ** 31), 2 ** 62, 10 ** 30, 0.5, -0.5, 1e308, True, False, [],
                       {}, [1, 2], [None], ["full_attention"], {"a": 1}])


def _one_message(outcome, what: str) -> None:
    assert INTERNAL not in outcome.stderr, (what, outcome.stderr)
    assert "Traceback" not in outcome.stderr, (what, outcome.stderr)
    assert outcome.code in (0, 1, 2), (what, outcome.code, outcome.stderr)
    if outcome.code:
        errors = [line for line in outcome.error_lines if line.startswith("attnscope: error: ")]
        assert len(errors) == 1, (what, outcome.stderr)
        if outcome.code == 1:  # a run-time refusal: only memory or time
            assert "memory" in outcome.stderr or "GiB" in outcome.stderr, (what, outcome.stderr)


@pytest.mark.parametrize("family", FUZZED)
def test_fuzzed_config_is_one_message(family, folders, tmp_path_factory):
    """A field of config.json set to null, a wrong type, a negative or huge value: anatomy, head and head --check
    end in one message (exit 2, or 1 for memory) or run; never an internal error."""
    folder = folders(family)
    paths = _paths(json.loads((folder / "config.json").read_text()))

    @fuzz_settings(4)
    @given(st.sampled_from(paths), BAD, st.sampled_from(["anatomy", "head", "check"]))
    def run(path, value, command):
        target = _with(folder, tmp_path_factory.mktemp("fuzzed"), path, value)
        args = (["anatomy", str(target), "--tokens", "16"] if command == "anatomy"
                else ["head", "--model", str(target), "--text", TEXT, *(["--check"] if command == "check" else [])])
        _one_message(run_main(*args), f"{family} {'.'.join(path)}={value!r} {command}")

    run()


@pytest.mark.parametrize(("family", "path", "value", "command", "words"), [
    ("kimi_linear", ("linear_attn_config",), {"full_attn_layers": "2", "kda_layers": [1, 3]}, "head",
     ["linear_attn_config.full_attn_layers"]),
    ("kimi_linear", ("linear_attn_config",), {"num_heads": "4"}, "head", ["linear_attn_config.num_heads"]),
    ("deepseek_v32", ("index_topk",), None, "check", ["index_topk", "expected int"]),
])
def test_reported_configs_are_one_message(family, path, value, command, words, folders, tmp_path):
    """The two the issue names: Kimi Linear's malformed linear_attn_config (an AttributeError before) and
    deepseek_v32's index_topk null under --check (transformers' dataclass validation, an internal error before)."""
    target = _with(folders(family), tmp_path / "m", path, value)
    outcome = run_main("head", "--model", str(target), "--text", TEXT, *(["--check"] if command == "check" else []))
    assert outcome.code == 2, outcome.stderr
    _one_message(outcome, command)
    for word in words:
        assert word in outcome.stderr


# --- item 23: MiniMax in anatomy -----------------------------------------------------------------------------

@pytest.mark.parametrize("window", [None, 6])
def test_minimax_anatomy_counts_what_its_cache_holds(window, tmp_path):
    """Each layer's bytes are what MiniMaxCache holds after a 16-token forward (its lightning layers' linear_cache
    too), and the keys the 16th token attends to are the ones its eager attention weights are not 0 on: with a
    sliding_window, the softmax layers are sliding (MiniMaxModel's create_sliding_window_causal_mask)."""
    import transformers as tf
    from tiny_models import perturb

    from attnscope.anatomy.read import read_anatomy

    config = tf.MiniMaxConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8, num_hidden_layers=4, num_local_experts=2,
                              num_experts_per_tok=1, block_size=4, sliding_window=window,
                              layer_types=["linear_attention", "full_attention"] * 2, max_position_embeddings=64)
    config.save_pretrained(tmp_path)
    anatomy = read_anatomy(str(tmp_path), tokens=16)
    torch.manual_seed(0)
    model = perturb(tf.MiniMaxForCausalLM(config).eval())
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        out = model(torch.arange(1, 17)[None], use_cache=True, output_attentions=True)
    cache = out.past_key_values
    for index, layer in anatomy.layers:
        sizes = anatomy.sizes(layer)
        linear = cache.linear_cache[index] if index < len(cache.linear_cache) else []
        if isinstance(linear, torch.Tensor):
            held = linear.numel() * linear.element_size()
        else:
            held = sum(t.numel() * t.element_size() for t in (cache.layers[index].keys, cache.layers[index].values))
        assert sizes.kv_cache_bytes == held, (index, layer.label)
        if layer.attention != "linear":
            assert layer.attention == ("full" if window is None else "sliding")
            seen = int((out.attentions[index][0, :, -1] > 0).sum(-1).max())
            assert sizes.keys == seen == (16 if window is None else window)
    assert "sliding_window" not in anatomy.uninterpreted
