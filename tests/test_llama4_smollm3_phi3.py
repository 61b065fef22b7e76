"""Llama 4 (text, and the language model of a multimodal checkpoint), SmolLM3 and Phi-3/Phi-4 against transformers'
own models: tiny random ones covering every layer kind (chunked, NoPE with temperature tuning, full, sliding),
saved with save_pretrained. The dumped slices equal the model's parameters; the --text pattern equals eager
output_attentions for every (layer, head) in float32; the traced layer's output equals the attention module's
own; configs as transformers 4.4x saved them give the same patterns as their eager models."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from tiny_llama4_smollm3_phi3 import NAMES, build, text_model
from tiny_models import SENTENCE, assert_every_head_dumped

from attnscope.cli import app
from attnscope.models.config import read_config
from attnscope.models.families import open_model
from attnscope.models.weights import head_weights
from attnscope.runs.head import HeadOptions, run_head

CHUNK = WINDOW = 4


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (folder, eager model), each built the first time a test asks for it."""
    cache: dict[str, tuple[Path, object]] = {}

    def get(name: str):
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            cache[name] = folder, build(name, folder)
        return cache[name]

    return get


def _eager(folder: Path, model, name: str):
    """Input ids, every layer's attentions and every attention module's output on SENTENCE, from transformers."""
    from transformers import AutoTokenizer

    encoded = AutoTokenizer.from_pretrained(folder)(SENTENCE, return_tensors="pt")
    outputs: dict[int, torch.Tensor] = {}

    def keep(layer: int):
        def hook(module, args, out) -> None:
            outputs[layer] = out[0] if isinstance(out, tuple) else out
        return hook

    hooks = [layer.self_attn.register_forward_hook(keep(i)) for i, layer in enumerate(text_model(name, model).layers)]
    with torch.no_grad():
        attentions = model(**encoded, output_attentions=True).attentions
    for hook in hooks:
        hook.remove()
    return encoded["input_ids"][0].tolist(), attentions, outputs


@pytest.fixture(scope="module")
def eager(built):
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            folder, model = built(name)
            cache[name] = _eager(folder, model, name)
        return cache[name]

    return get


def _assert_every_head_equals_eager(folder: Path, eager_run) -> None:
    """One run per layer: its every head (`all_heads`, the layer's attention step) and the head's own slice."""
    ids, attentions, outputs = eager_run
    for layer, per_layer in enumerate(attentions):
        head = 3 - layer % 2  # 3 and 2 share KV head 1 (GQA)
        result = run_head(HeadOptions(model=str(folder), layer=layer, head=head, text=SENTENCE))
        assert result.encoded.ids == ids
        torch.testing.assert_close(result.all_heads, per_layer[0], atol=1e-5, rtol=1e-5, msg=f"layer {layer}")
        torch.testing.assert_close(result.attention, per_layer[0, head], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result.run.layer["x"], outputs[layer], atol=1e-5, rtol=1e-5)


def _open(folder: Path):
    return open_model(folder, read_config(folder))


# --- the pattern on a sentence ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_text_pattern_and_output_equal_eager_for_every_layer_and_head(built, eager, name):
    _assert_every_head_equals_eager(built(name)[0], eager(name))


@pytest.mark.parametrize(("name", "layer", "kind"), [
    ("llama4", 0, "chunked"), ("llama4", 1, "nope"), ("llama4", 2, "chunked"), ("llama4", 3, "nope"),
    ("smollm3", 0, "full"), ("smollm3", 1, "nope"), ("smollm3", 2, "sliding"), ("smollm3", 3, "nope-sliding"),
    ("phi3", 1, "sliding"), ("phi4", 1, "full")])
def test_each_layer_kind_is_traced_with_its_own_steps(built, name, layer, kind):
    result = run_head(HeadOptions(model=str(built(name)[0]), layer=layer, head=3, text=SENTENCE))
    steps, spec, n = result.run.layer, result.run.spec, result.attention.shape[0]
    assert n > 2 * CHUNK
    rotated = "nope" not in kind
    assert ("Q_rot" in steps and "cos" in steps) == rotated and (spec.rope is not None) == rotated
    assert ("Q_normed" in steps and "K_normed" in steps) == (name == "llama4" and rotated)
    assert ("attn_scales" in steps and "Q_tuned" in steps) == (name == "llama4" and not rotated)
    positions = torch.arange(n)
    causal = positions[None, :] <= positions[:, None]
    if kind == "chunked":
        seen = causal & (positions[None, :] // CHUNK == positions[:, None] // CHUNK)
        assert spec.chunk == CHUNK and f"chunk({CHUNK}, upper-left)" in steps.step("masked_scores").op
    elif "sliding" in kind:
        seen = causal & (positions[:, None] - positions[None, :] < WINDOW)
        assert spec.window == WINDOW
    else:
        seen = causal
        assert spec.chunk is None and spec.window is None
    assert bool((result.attention[~seen] == 0).all()) and bool((result.attention[seen] > 0).all())
    assert any("NoPE layer" in note for note in steps.notes) == (not rotated)
    head = [s.name for s in result.run.head.steps]
    assert head[:4] == ["X", "Q", "K", "V"] and head[-4:] == ["attention", "out", "value_norms", "weighted"]
    assert ("Q_normed" in head) == ("Q_normed" in steps) and ("Q_tuned" in head) == ("Q_tuned" in steps)


def test_llama4_temperature_and_qk_norm_are_transformers_formulas(built):
    folder, model = built("llama4")
    nope = run_head(HeadOptions(model=str(folder), layer=1, head=2, text=SENTENCE)).run.layer
    n = nope["attn_scales"].shape[0]
    expected = [1 + 0.5 * math.log(1 + math.floor((p + 1) / 2)) for p in range(n)]  # floor_scale 2, attn_scale 0.5
    torch.testing.assert_close(nope["attn_scales"].double(), torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(nope["Q_tuned"], nope["Q_split"] * nope["attn_scales"][:, None])
    assert nope.step("attn_scales").op.startswith("log1p(floor((i + 1) / 2)) * 0.5 + 1")
    from transformers.models.llama4.modeling_llama4 import Llama4TextL2Norm

    chunked = run_head(HeadOptions(model=str(folder), layer=0, head=2, text=SENTENCE)).run.layer
    norm = Llama4TextL2Norm(model.config.rms_norm_eps)
    torch.testing.assert_close(chunked["Q_normed"], norm(chunked["Q_rot"]))
    torch.testing.assert_close(chunked["K_normed"], norm(chunked["K_rot"]))
    assert chunked.step("scores").op.startswith("Q_normed @ K_rep")
    assert "interleaved" in chunked.step("cos").op and "llama3" in chunked.step("cos").op


# --- where head h lives -----------------------------------------------------------------------------------------


def _expected_slices(name: str, model, layer: int, head: int) -> dict[str, torch.Tensor]:
    attn = text_model(name, model).layers[layer].self_attn
    d, group, config = attn.head_dim, model.config.get_text_config().num_attention_heads // (
        model.config.get_text_config().num_key_value_heads), model.config.get_text_config()
    q, kv = slice(head * d, (head + 1) * d), slice(head // group * d, (head // group + 1) * d)
    if name.startswith("phi"):
        n_q, n_kv = config.num_attention_heads * d, config.num_key_value_heads * d
        fused = attn.qkv_proj.weight
        return {"W_Q": fused[:n_q][q], "W_K": fused[n_q : n_q + n_kv][kv], "W_V": fused[n_q + n_kv :][kv],
                "W_O": attn.o_proj.weight[:, q]}
    return {"W_Q": attn.q_proj.weight[q], "W_K": attn.k_proj.weight[kv], "W_V": attn.v_proj.weight[kv],
            "W_O": attn.o_proj.weight[:, q]}


@pytest.mark.parametrize("name", NAMES)
def test_dumped_slices_equal_the_models_parameters(built, name):
    folder, model = built(name)
    assert_every_head_dumped(folder, lambda layer, head: _expected_slices(name, model, layer, head), name)


@pytest.mark.parametrize(("name", "sources"), [
    ("phi3", {"W_Q": "model.layers.1.self_attn.qkv_proj.weight[24:32, :]",
              "W_K": "model.layers.1.self_attn.qkv_proj.weight[40:48, :]",
              "W_V": "model.layers.1.self_attn.qkv_proj.weight[56:64, :]",
              "W_O": "model.layers.1.self_attn.o_proj.weight[:, 24:32]"}),
    ("llama4_mm", {"W_Q": "language_model.model.layers.1.self_attn.q_proj.weight[24:32, :]",
                   "W_K": "language_model.model.layers.1.self_attn.k_proj.weight[8:16, :]"}),
    ("smollm3", {"W_V": "model.layers.1.self_attn.v_proj.weight[8:16, :]"}),
])
def test_sources_name_key_and_slice(built, name, sources):
    weights = head_weights(_open(built(name)[0]), 1, 3)
    assert {key: weights.sources[key] for key in sources} == sources
    if name == "phi3":
        assert weights.notes[0] == ("qkv_proj stacks Q (4·8 rows), K and V (2·8 each): head 3 has W_Q rows 24:32, "
                                    "W_K rows 40:48, W_V rows 56:64")


# --- configs as transformers 4.4x saved them ----------------------------------------------------------------------


def _older(config: dict, name: str) -> dict:
    """The same model as an older transformers wrote it: rope_theta + rope_scaling for rope_parameters, no
    layer_types (nor no_rope_layers / moe_layers where an interval says it)."""
    def flat(c: dict) -> dict:
        c = dict(c)
        parameters = dict(c.pop("rope_parameters"))
        c["rope_theta"] = parameters.pop("rope_theta")
        if name.startswith("phi"):  # Phi-3's 128k configs called longrope "su"
            parameters["type"] = "su" if name == "phi3" else parameters.pop("rope_type")
            parameters.pop("rope_type", None)
            c["partial_rotary_factor"] = parameters.pop("partial_rotary_factor", 1.0)
        c["rope_scaling"] = parameters if parameters.get("rope_type", parameters.get("type")) != "default" else None
        for key in ("layer_types", "no_rope_layers", "moe_layers"):
            c.pop(key, None)
        return c

    if "text_config" in config:
        return config | {"text_config": flat(config["text_config"])}
    return flat(config)


@pytest.mark.parametrize("name", NAMES)
def test_older_config_forms_give_the_eager_pattern(built, tmp_path, name):
    from transformers import AutoConfig

    folder = tmp_path / name
    shutil.copytree(built(name)[0], folder)
    path = folder / "config.json"
    path.write_text(json.dumps(_older(json.loads(path.read_text()), name)))
    model = type(built(name)[1]).from_pretrained(folder, attn_implementation="eager").eval()
    saved = json.loads(path.read_text())
    assert "rope_parameters" not in saved.get("text_config", saved) and "layer_types" not in saved
    if not name.startswith("phi"):  # transformers derives the layer kinds from the intervals, as attnscope does
        assert AutoConfig.from_pretrained(folder).get_text_config().layer_types is not None
    _assert_every_head_equals_eager(folder, _eager(folder, model, name))


# --- the command ---------------------------------------------------------------------------------------------------


def test_cli_json_save_and_all_heads(runner, built, tmp_path):
    folder, _ = built("llama4")
    target = tmp_path / "run.safetensors"
    result = runner.invoke(app, ["head", "--model", str(folder), "--layer", "2", "--head", "1", "--text", SENTENCE,
                                 "--json", "--save", str(target), "--all-heads"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["traced"] is True and payload["model"]["model_type"] == "llama4_text"
    attention = payload["layer_attention"]
    assert attention["chunk"] == CHUNK and attention["temperature"] is None and attention["window"] is None
    assert attention["rope"] == {"base": 500000.0, "scaling": "llama3", "fraction": 1.0, "pairing": "interleaved"}
    assert [s["name"] for s in payload["steps"]][:8] == ["X", "Q", "K", "V", "Q_rot", "K_rot", "Q_normed",
                                                         "K_normed"]
    assert len(payload["heads"]) == 4
    nope = json.loads(runner.invoke(app, ["head", "--model", str(folder), "--layer", "3", "--head", "0", "--text",
                                          SENTENCE, "--json"]).stdout)["layer_attention"]
    assert nope["rope"] is None and nope["chunk"] is None
    assert nope["temperature"] == {"floor_scale": 2.0, "attn_scale": 0.5}
    from safetensors.torch import load_file

    saved = load_file(target)
    assert {"Q_normed", "K_normed", "layer.Q_normed", "layer.cos", "attention", "W_Q"} <= set(saved)


@pytest.mark.parametrize("name", ["llama4_mm", "phi3", "smollm3"])
def test_a_weight_dump_imports_neither_torch_nor_transformers(built, name):
    import subprocess
    import sys

    code = (f"import sys; from attnscope.cli import main; sys.argv = ['attnscope', 'head', '--model', "
            f"{str(built(name)[0])!r}, '--layer', '1', '--head', '3', '--json']\ntry:\n    main()\nexcept SystemExit:\n"
            "    pass\nprint('LOADED', sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}), "
            "file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "LOADED []" in result.stderr, result.stderr
    assert len(json.loads(result.stdout)["tensors"]) == 4


def test_the_table_says_the_layer_kind(runner, built):
    result = runner.invoke(app, ["head", "--model", str(built("llama4")[0]), "--layer", "1", "--head", "0",
                                 "--text", SENTENCE])
    assert result.exit_code == 0, result.output
    words = " ".join(result.stdout.split())  # lines wrap at the terminal's width
    assert "temperature tuning (floor_scale 2, attn_scale 0.5)" in words
    assert "NoPE layer" in words and "attn_scales" in words
    phi = runner.invoke(app, ["head", "--model", str(built("phi4")[0]), "--layer", "0", "--head", "3"])
    assert "qkv_proj stacks Q" in phi.stdout and "qkv_proj.weight[56:64, :]" in phi.stdout


@pytest.mark.parametrize(("name", "layer", "edit", "words"), [
    ("llama4", 1, lambda c: c | {"attention_chunk_size": None}, ["layer 0 is chunked_attention",
                                                                 "attention_chunk_size is not set"]),
    ("llama4", 1, lambda c: c | {"no_rope_layers": [1, 0]}, ["no_rope_layers must be a list of 4 numbers 0 or 1"]),
    ("llama4_mm", 1, lambda c: {k: v for k, v in c.items() if k != "text_config"}, ["has none"]),
    ("smollm3", 2, lambda c: c | {"sliding_window": None}, ["layer_types makes layer 2 sliding_attention"]),
    ("phi4", 1, lambda c: c | {"rope_parameters": c["rope_parameters"] | {"short_factor": [1.0]}},
     ["short_factor has 1 numbers", "needs 3"]),
    ("phi3", 1, lambda c: c | {"rope_parameters": {"rope_type": "wobbly", "rope_theta": 10000.0}}, ["wobbly"]),
])
def test_bad_configs_are_one_line(built, tmp_path, name, layer, edit, words):
    from cli_main import assert_usage_error, run_main

    folder = tmp_path / name
    shutil.copytree(built(name)[0], folder)
    path = folder / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    assert_usage_error(run_main("head", "--model", str(folder), "--layer", str(layer), "--head", "0", "--text",
                                SENTENCE), *words)
