"""Gemma 4 (text, with MoE, and the text part of the multimodal checkpoint) against transformers' own models: tiny
ones saved with save_pretrained, every weight drawn off its init (tiny_gemma4.py). Every layer's pattern and output
equal eager `output_attentions` and the attention module's output to 1e-5 (sliding, full with its own d_head and
K = V, and the two layers that read another's KV cache); the dumped slices are the model's parameters (the owner's
keys for a shared layer); greedy decoding equals transformers' `generate` with its cache (nothing held for the
shared layers); RoPE's tables equal `Gemma4TextRotaryEmbedding`'s; a config without per_layer_config reads the same."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from cli_main import assert_usage_error, run_main
from tiny_gemma4 import FAMILIES, WINDOW, build, decoder_layers
from tiny_models import SENTENCE, cached_builder, with_config

from attnscope.models import tokenizer
from attnscope.models.config import read_config
from attnscope.models.families import open_model
from attnscope.models.forward.run import run_layer
from attnscope.models.forward.stream import generate
from attnscope.models.nopage.cache_names import cache_of
from attnscope.models.weights import head_weights


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return cached_builder(tmp_path_factory, build)


def _open(folder: Path):
    return open_model(folder, read_config(folder))


def _variant(source: Path, tmp_path: Path, edit) -> Path:
    return with_config(source, tmp_path / "variant", edit)


def _eager(folder: Path, model) -> tuple[list[int], tuple, dict[int, torch.Tensor]]:
    ids = tokenizer.encode(folder, SENTENCE).ids
    outputs: dict[int, torch.Tensor] = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out[0]))
             for i, layer in enumerate(decoder_layers(model))]
    with torch.no_grad():
        attentions = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    for hook in hooks:
        hook.remove()
    return ids, attentions, outputs


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_equals_eager(built, family):
    folder, reference = built(family)
    ids, attentions, outputs = _eager(folder, reference)
    model = _open(folder)
    assert len(ids) > WINDOW + 2
    for layer in range(model.n_layer):
        with model.checkpoint:
            run = run_layer(model, ids, [0] * len(ids), layer, 3)
        torch.testing.assert_close(run.layer["attention"][0], attentions[layer][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(run.layer["x"], outputs[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(run.head["attention"], attentions[layer][0, 3], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def large(built, tmp_path_factory):
    """The tiny Gemma 4 (sliding_window 4, full layers with K = V, every weight drawn off its init) with its
    qk-norm weights at a trained model's size, N(0, 1.2) around ±4: 4 times the drawn weight plus 4 with its sign.
    Returns its folder and transformers' eager model read back."""
    import transformers as tf

    source, _ = built("gemma4_text")
    folder = tmp_path_factory.mktemp("large")
    model = tf.AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(4.0).add_(4.0 * torch.sign(p))
    model.save_pretrained(folder)
    for extra in source.iterdir():
        if extra.name.startswith("tokenizer") or extra.name == "special_tokens_map.json":
            shutil.copy(extra, folder / extra.name)
    reference = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert reference.config.sliding_window == 4 and "full_attention" in reference.config.layer_types
    norms = [p for n, p in reference.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert min(float(p.abs().min()) for p in norms) > 2.0  # far from 1 everywhere
    return folder, reference


def test_large_logits_agree_with_eager_to_the_last_bit(large):
    """Gemma 4 scales RMS-normed Q and K by 1: with trained-size norm weights its logits are large, and any rounding
    of the layers below differs visibly later. Through F.scaled_dot_product_attention's fused kernel the 4th
    layer was 1.7e-5 from eager (issue 43, item 24: 2.1e-5 on a held-out config); in eager's order, 0."""
    folder, reference = large
    ids, attentions, _ = _eager(folder, reference)
    mine = _open(folder)
    for layer in range(mine.n_layer):
        with mine.checkpoint:
            run = run_layer(mine, ids, [0] * len(ids), layer, 0)
        torch.testing.assert_close(run.layer["attention"][0], attentions[layer][0], atol=1e-6, rtol=0)


def test_large_logits_agree_with_eager_in_head_all_layers_and_check(large):
    """Issue 43, item 24 through the command line: `head --check` on each layer (sliding and full, own and shared
    keys) and `--all-layers --check`, the shown patterns and --check's differences all within 1e-6 of transformers'
    eager output_attentions, where --check's own tolerance is 2e-5. Through the fused kernel below the layer shown,
    `head --layer 3` (full) was 2.6e-6 off and `--layer 4` (sliding, on layer 2's keys) 2.8e-5: --check FAILed."""
    folder, reference = large
    ids, attentions, _ = _eager(folder, reference)
    n_layer = len(attentions)
    for layer in range(n_layer):
        outcome = run_main("head", "--model", str(folder), "--text", SENTENCE, "--layer", str(layer), "--head", "1",
                           "--check", "--json")
        assert outcome.code == 0, outcome.stderr
        data = outcome.json()
        got = torch.tensor(data["attention"], dtype=torch.float32)
        torch.testing.assert_close(got, attentions[layer][0, 1], atol=1e-6, rtol=0)
        assert data["check"] and all(c["passed"] for c in data["check"])
        assert max(c["max_abs_diff"] for c in data["check"]) <= 1e-6, (layer, data["check"])
    outcome = run_main("head", "--model", str(folder), "--text", SENTENCE, "--layer", str(n_layer - 1),
                       "--all-layers", "--check", "--json")
    assert outcome.code == 0, outcome.stderr
    data = outcome.json()
    assert [entry["layer"] for entry in data["all_layers"]] == list(range(n_layer))
    for entry in data["all_layers"]:
        got = torch.tensor(entry["attention"], dtype=torch.float32)
        torch.testing.assert_close(got, attentions[entry["layer"]][0], atol=1e-6, rtol=0)
    assert data["check"] and all(c["passed"] for c in data["check"])
    assert max(c["max_abs_diff"] for c in data["check"]) <= 1e-6, data["check"]


def test_layer_kinds_sizes_and_owners(built):
    folder, reference = built("gemma4_text")
    model = _open(folder)
    config = reference.config
    modules = [layer.self_attn for layer in decoder_layers(reference)]
    assert [model.layer_type(i) for i in range(6)] == config.layer_types
    assert model.sizes == [(m.head_dim, config.num_attention_heads // m.num_key_value_groups) for m in modules]
    assert [model.k_eq_v(i) for i in range(6)] == [m.use_alternative_attention for m in modules]
    modes = config.kv_sharing_modes
    assert [o is not None for o in model.owners] == [mode == "reuse" for mode in modes]
    assert [model.stores(i) for i in range(6)] == [mode == "store" for mode in modes]
    assert model.owners[4:] == [2, 3]
    assert [model.window(i) for i in range(6)] == [m.sliding_window for m in modules]


def test_steps_name_the_owner_and_the_normed_values(built):
    folder, _ = built("gemma4_text")
    model = _open(folder)
    ids = tokenizer.encode(folder, SENTENCE).ids
    with model.checkpoint:
        shared, full = (run_layer(model, ids, [0] * len(ids), layer, 1) for layer in (5, 1))
    assert "K_feat" not in shared.layer and "V_split" not in shared.layer
    assert "layer 3's keys" in shared.layer.step("K_shared").op
    assert any("K_shared and V_shared are layer 3's" in note for note in shared.layer.notes)
    torch.testing.assert_close(shared.head["K"], shared.layer["K_shared"][0, 0])  # one KV head serves all four
    assert "no weight" in full.layer.step("V_normed").op
    assert torch.equal(full.layer["V_feat"], full.layer["K_feat"])  # K = V: one projection
    rms = full.layer["V_normed"].pow(2).mean(-1)
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-4, rtol=0)
    assert full.head["V_normed"].shape == (len(ids), 32)


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4"])
def test_dumped_slices_are_the_parameters(built, family):
    folder, reference = built(family)
    model = _open(folder)
    modules = [layer.self_attn for layer in decoder_layers(reference)]
    for layer in range(model.n_layer):
        d, n_kv = model.sizes[layer]
        owner = modules[model.owners[layer] if model.owners[layer] is not None else layer]
        values = owner.k_proj if owner.v_proj is None else owner.v_proj
        for head in range(model.n_head):
            g = head // (model.n_head // n_kv)
            got = head_weights(model, layer, head).as_torch()
            mine = modules[layer]
            assert torch.equal(got["W_Q"], mine.q_proj.weight[head * d:(head + 1) * d])
            assert torch.equal(got["W_K"], owner.k_proj.weight[g * d:(g + 1) * d])
            assert torch.equal(got["W_V"], values.weight[g * d:(g + 1) * d])
            assert torch.equal(got["k_norm"], owner.k_norm.weight)
            assert torch.equal(got["W_O"], mine.o_proj.weight[:, head * d:(head + 1) * d])


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_equals_transformers_generate(built, family):
    folder, reference = built(family)
    ids = tokenizer.encode(folder, "The cat sat on the mat").ids
    model = _open(folder)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=5, min_new_tokens=5, do_sample=False,
                                 output_attentions=True, return_dict_in_generate=True)
    held = sum(tensor.numel() * tensor.element_size() for cache in cache_of(out).layers
               if cache.keys is not None for tensor in (cache.keys, cache.values))
    # full with K = V; sliding and full reading layers 2's and 3's caches (the text model; the others: the last)
    for layer in (1, 4, 5) if family == "gemma4_text" else (5,):
        with model.checkpoint:
            steps = generate(model, ids, 5, layer)
        assert [s.token_id for s in steps] == out.sequences[0, len(ids):].tolist()
        for t, step in enumerate(steps):
            theirs = out.attentions[t][layer][0, :, -1]  # [n_head, keys]
            torch.testing.assert_close(step.attention[:, -theirs.shape[-1]:], theirs, atol=1e-5, rtol=0)
        assert steps[-1].kv_cache_bytes == held


def test_rope_tables_equal_transformers(built):
    folder, reference = built("gemma4_text")
    model = _open(folder)
    rotary = reference.model.rotary_emb
    positions = torch.arange(10)[None]
    for layer, kind in ((0, "sliding_attention"), (1, "full_attention")):
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions, kind)
        rope = model.attention_spec(layer).rope
        mine_cos, mine_sin = rope.cos_sin(10, model.sizes[layer][0], torch.float32, torch.device("cpu"))
        torch.testing.assert_close(mine_cos, cos[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(mine_sin, sin[0], atol=1e-6, rtol=0)
    assert model.attention_spec(1).rope.kind == "proportional"


def test_config_without_per_layer_config_reads_the_same(built, tmp_path):
    """A config as Google writes it: global_head_dim and num_global_key_value_heads, no per_layer_config."""
    from transformers import AutoConfig

    folder, _ = built("gemma4_text")

    def edit(config):
        config.pop("per_layer_config")
        return {**config, "global_head_dim": 32, "num_global_key_value_heads": 1}

    variant = _variant(folder, tmp_path, edit)
    theirs = AutoConfig.from_pretrained(variant)
    assert _open(variant).sizes == _open(folder).sizes == [
        (theirs.per_layer_config[i].head_dim, theirs.per_layer_config[i].num_key_value_heads) for i in range(6)]


def test_per_layer_config_keys_written_zero_padded(built, tmp_path):
    """transformers writes per_layer_config's keys to the width of the largest layer number ("05" of 30 layers)."""
    folder, _ = built("gemma4_text")

    def edit(config):
        return {**config, "per_layer_config": {f"{int(k):02d}": v for k, v in config["per_layer_config"].items()}}

    assert _open(_variant(folder, tmp_path, edit)).sizes == _open(folder).sizes


def test_bad_configs_are_refused_in_one_line(built, tmp_path):
    folder, _ = built("gemma4_text")
    too_many = _variant(folder, tmp_path, lambda c: {**c, "num_kv_shared_layers": 6})
    assert_usage_error(run_main("head", "--model", str(too_many), "--text", "The cat"), "num_kv_shared_layers 6")
    shutil.rmtree(too_many)
    encoder = _variant(folder, tmp_path, lambda c: {**c, "use_bidirectional_attention": "all"})
    assert_usage_error(run_main("head", "--model", str(encoder), "--text", "The cat", "--generate", "2"),
                       "--generate", "attends both ways")


def test_bidirectional_all_equals_eager_on_every_layer(tmp_path, monkeypatch):
    """use_bidirectional_attention "all" (Gemma 4 as an encoder): every layer equal to eager, whose masks are then
    transformers' bidirectional ones (a full layer sees every key, a sliding one |i - j| <= config.json's
    sliding_window // 2 + 1: Gemma4TextConfig.__post_init__ and sliding_window_bidirectional_overlay)."""
    import transformers as tf
    from tiny_gemma4 import _tokenizer, text_config
    from tiny_models import save_random

    folder = tmp_path / "encoder"
    words = _tokenizer()
    reference = save_random(folder, words, text_config(len(words), use_bidirectional_attention="all"),
                            tf.Gemma4ForCausalLM, 47)
    assert reference.config.is_causal is False and reference.config.sliding_window == WINDOW // 2 + 1
    ids, attentions, outputs = _eager(folder, reference)
    n = len(ids)
    reach = WINDOW // 2 + 1
    distance = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs()  # [n, n]
    model = _open(folder)
    for layer in range(model.n_layer):
        theirs = attentions[layer][0]  # [n_head, n, n]
        sliding = model.layer_type(layer) == "sliding_attention"
        seen = distance <= reach if sliding else torch.ones(n, n, dtype=torch.bool)
        assert bool((theirs[:, ~seen] == 0).all()) and bool((theirs[:, seen & (distance > 0)] > 0).all())
        with model.checkpoint:
            run = run_layer(model, ids, [0] * n, layer, 1)
        torch.testing.assert_close(run.layer["attention"][0], theirs, atol=1e-5, rtol=0)
        torch.testing.assert_close(run.layer["x"], outputs[layer], atol=1e-5, rtol=1e-5)
    outcome = run_main("head", "--model", str(folder), "--text", SENTENCE, "--layer", "4", "--all-layers",
                       "--check", "--json")
    assert outcome.code == 0, outcome.stderr
    assert all(c["passed"] for c in outcome.json()["check"])
    from attnscope.models.forward import long

    monkeypatch.setattr(long, "LONG_TOKENS", 8)  # a long input's blocks of rows: the window centred on each row
    monkeypatch.setattr(long, "BLOCK_ROWS", 5)
    for layer in (2, 5):  # sliding (its own keys), full reading layer 3's
        rows = run_main("head", "--model", str(folder), "--text", SENTENCE, "--layer", str(layer), "--head", "2",
                        "--rows", f"0:{n}", "--json")
        assert rows.code == 0, rows.stderr
        assert "attention" not in rows.json()  # the blocked path
        torch.testing.assert_close(torch.tensor(rows.json()["rows"]["attention"]), attentions[layer][0, 2],
                                   atol=1e-5, rtol=0)


def test_cli_json_of_a_shared_layer(built):
    folder, _ = built("gemma4_text")
    outcome = run_main("head", "--model", str(folder), "--layer", "5", "--text", "The cat sat on the mat", "--json")
    assert outcome.code == 0, outcome.stderr
    data = outcome.json()
    names = [step["name"] for step in data["layer_steps"]]
    assert "K_shared" in names and "V_shared" in names and "K_feat" not in names
    assert any("layer 3's" in note for note in data["notes"])


def test_attention_biases(tmp_path):
    """attention_bias: q, k, v and o biased (v's is k's where K = V), on every kind of layer."""
    folder = tmp_path / "biased"
    reference = build("gemma4_text", folder, attention_bias=True)
    ids, attentions, outputs = _eager(folder, reference)
    model = _open(folder)
    for layer in (0, 1, 5):
        with model.checkpoint:
            run = run_layer(model, ids, [0] * len(ids), layer, 0)
        torch.testing.assert_close(run.layer["attention"][0], attentions[layer][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(run.layer["x"], outputs[layer], atol=1e-5, rtol=1e-5)
    owner = decoder_layers(reference)[3].self_attn
    got = head_weights(model, 5, 2).as_torch()
    assert torch.equal(got["b_V"], owner.k_proj.bias[:32]) and torch.equal(got["b_K"], owner.k_proj.bias[:32])
