"""Three follow-ups, each against a reference that shares no code with attnscope:

1. `heads[].stats.induction` (--all-heads) wherever `all_layers[].stats` has it, with layer L's value: held
   against a float64 formula of the induction score over transformers' eager output_attentions (a tiny LLaMA, a
   family traced through the interface, a VLM whose image tokens are one placeholder id, never a repeat); a
   vision tower's tokens have none; the kind reads the same in the --all-heads table and the --all-layers grid.
2. A vision tower's "moved" table, sinks view and page name the token at position 0 ([CLS]; SigLIP's patch
   p(0,0)) where a text's say "the first token"; a text's words stay as they were.
3. The interface's Q step says RoPE only on the layers whose module turns Q and K, as each family's modeling code
   decides (Cohere2's, Cohere2-MoE's, EXAONE 4's, ...): held against the layers that called the modeling file's
   own `apply_rotary_pos_emb` in transformers' eager run.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from rich.cells import cell_len
from tiny_models import SENTENCE

from attnscope.cli import app

TEXT = "The cat sat on the mat. The cat sat on the mat because it was tired."  # a repeated span: induction


def induction_score(A: torch.Tensor, ids: list[int], skip: set[int] = frozenset()) -> float | None:
    """The induction score of one `[n, n]` pattern in float64, from readings/headstats.py's definition: the mean,
    over the queries p whose token occurred earlier, of the weight on the keys k < p that followed an earlier
    occurrence (ids[k - 1] == ids[p]); rows with no such key are left out. Positions in `skip` (a VLM's image
    tokens) match nothing. None where no row has a key to follow."""
    A = A.double()
    rows = []
    for p in range(len(ids)):
        keys = [k for k in range(1, p) if k - 1 not in skip and p not in skip and ids[k - 1] == ids[p]]
        if keys and float(A[p].sum()) > 0:
            rows.append(sum(float(A[p, k]) for k in keys))
    return sum(rows) / len(rows) if rows else None


def invoke(runner, *args: str, width: int | None = None):
    env = {"NO_COLOR": "1", **({"COLUMNS": str(width)} if width else {})}
    result = runner.invoke(app, list(args), env=env)
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tiny_models import build

    folder = tmp_path_factory.mktemp("llama")
    return folder, build("llama", folder)


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    from tiny_vision import build, draw

    root = tmp_path_factory.mktemp("towers")
    folders = {kind: (root / kind, build(kind, root / kind)) for kind in ("vit", "siglip_vision_model")}
    return folders, draw(root / "cat.png")


# --- 1. induction in heads[].stats ---------------------------------------------------------------------------


def test_all_heads_stats_hold_the_induction_score_of_all_layers(runner, llama):
    folder, reference = llama
    base = ["head", "--model", str(folder), "--layer", "1", "--head", "0", "--text", TEXT, "--json"]
    heads = json.loads(invoke(runner, *base, "--all-heads").stdout)
    every = json.loads(invoke(runner, *base, "--all-layers").stdout)
    ids = heads["token_ids"]
    assert len(ids) != len(set(ids))  # the text repeats tokens
    with torch.no_grad():
        eager = reference(torch.tensor([ids]), output_attentions=True).attentions
    for layer, entry in enumerate(every["all_layers"]):
        for h, stats in enumerate(entry["stats"]):
            assert stats["induction"] == pytest.approx(induction_score(eager[layer][0, h], ids), abs=1e-5)
    layer_1 = every["all_layers"][1]
    for h, head in enumerate(heads["heads"]):
        expected = induction_score(eager[1][0, h], ids)
        assert expected is not None and expected > 0
        assert head["stats"]["induction"] == pytest.approx(expected, abs=1e-5)
        assert head["stats"]["induction"] == pytest.approx(layer_1["stats"][h]["induction"], abs=1e-6)
        assert head["kind"] == layer_1["kinds"][h]


def test_an_interface_family_and_a_tower(runner, tmp_path, towers):
    """A family traced through transformers' attention interface gains it too; a tower's patches have no repeated
    token: no induction in either view."""
    from tiny_interface import build

    model, _ = build("cohere2", tmp_path / "cohere2")
    payload = json.loads(invoke(runner, "head", "--model", str(tmp_path / "cohere2"), "--layer", "3", "--text", TEXT,
                                "--all-heads", "--all-layers", "--json").stdout)
    ids = payload["token_ids"]
    with torch.no_grad():
        eager = model(torch.tensor([ids]), output_attentions=True).attentions
    for h, head in enumerate(payload["heads"]):
        assert head["stats"]["induction"] == pytest.approx(induction_score(eager[3][0, h], ids), abs=1e-5)
        assert head["stats"]["induction"] == pytest.approx(payload["all_layers"][3]["stats"][h]["induction"],
                                                           abs=1e-6)
    folders, picture = towers
    tower = json.loads(invoke(runner, "head", "--model", str(folders["vit"][0]), "--image", str(picture),
                              "--all-heads", "--all-layers", "--json").stdout)
    assert tower["heads"] and not any("induction" in head["stats"] for head in tower["heads"])
    assert not any("induction" in stats for entry in tower["all_layers"] for stats in entry["stats"])


def test_a_vlm_s_image_tokens_are_no_repeat(runner, tmp_path):
    """LLaVA's image is four tokens of one placeholder id: they neither repeat nor follow a repeat (the
    formula skips them), in --all-heads as in --all-layers."""
    from tiny_vlm import build, image, reference_inputs

    folder = tmp_path / "llava"
    model = build("llava", folder)
    picture = image(folder / "picture.png")
    text = "The cat sat. The cat sat."
    payload = json.loads(invoke(runner, "head", "--model", str(folder), "--text", text, "--image", str(picture),
                                "--layer", "1", "--all-heads", "--all-layers", "--json").stdout)
    inputs = reference_inputs(model, folder, text, picture)
    ids = inputs["input_ids"][0].tolist()
    assert payload["token_ids"] == ids
    skip = {t for t, i in enumerate(ids) if i == model.config.image_token_id}
    assert len(skip) == 4
    with torch.no_grad():
        eager = model(**inputs, output_attentions=True).attentions
    for h, head in enumerate(payload["heads"]):
        expected = induction_score(eager[1][0, h], ids, skip)
        assert expected is not None
        assert head["stats"]["induction"] == pytest.approx(expected, abs=1e-5)
        assert payload["all_layers"][1]["stats"][h]["induction"] == pytest.approx(expected, abs=1e-5)


def test_the_kind_reads_the_same_in_both_tables():
    """A head planted to complete the pattern ("A B ... A" attends to B) is `induction` in the --all-heads table,
    and I (legend: induction) in the --all-layers grid."""
    from rich.console import Console

    from attnscope.readings.headstats import LayerHeads
    from attnscope.render.beyond_layer import show_layers
    from attnscope.render.heads import show_heads

    ids = [5, 6, 7, 8, 5, 6, 7, 8]
    A = torch.eye(8)
    for p in range(5, 8):  # the second 6, 7, 8 attend to what followed the first: 7, 8, 5
        A[p] = 0.0
        A[p, p - 3] = 1.0
    heads = LayerHeads.of(torch.stack([A, torch.eye(8)]), "layer 0", [f"t{i}" for i in ids],
                          [f"t{i}" for i in ids], tokens=ids)
    assert [head["kind"] for head in heads.heads] == ["induction", "self"]
    assert heads.heads[0]["stats"]["induction"] == pytest.approx(induction_score(A, ids))
    console = Console(width=80, record=True, no_color=True, file=open("/dev/null", "w"))  # noqa: SIM115
    show_heads(console, heads)
    show_layers(console, [heads], 8)
    out = console.export_text()
    assert re.search(r"^ +0 +induction ", out, re.M)  # the table's row
    assert "I induction" in out and re.search(r"^layer 0 +I S", out, re.M)


# --- 2. a tower's token 0 by its name --------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "first"), [("vit", "[CLS]"), ("siglip_vision_model", "p(0,0)")])
def test_a_tower_names_its_token_0(runner, towers, kind, first):
    folders, picture = towers
    folder, tower = folders[kind]
    args = ["head", "--model", str(folder), "--image", str(picture), "--layer", "1", "--all-heads", "--all-layers"]
    out = invoke(runner, *args, width=80).stdout
    assert all(cell_len(line) <= 80 for line in out.splitlines())
    moved = out[out.index("what each head moves"):out.index("every layer, every head")]
    start = out.index("sinks: where each head parks")
    sinks = out[start:out.index("rollout", start)]
    assert "first token" not in moved + sinks and "first %" not in moved
    assert f" {first} %  value-wtd {first} %" in moved
    assert f"{first} %: its weight on {first} (token 0)," in moved.replace("\n", " ")
    assert f"weight on {first} (token 0), % (mean over queries)" in sinks
    assert f"parks its weight on {first} (token 0) but" in sinks.replace("\n", " ")
    from tiny_vision import eager_attentions

    eager = eager_attentions(tower, folder, picture)
    for layer in (0, 1):  # the sinks grid's row: each head's mean weight on token 0, in %
        row = re.search(rf"^layer {layer} +([\d ]+)$", sinks, re.M)
        assert row, sinks
        shown = [int(v) for v in row.group(1).split()]
        expected = [100 * float(eager[layer][0, h, :, 0].double().mean()) for h in range(eager[layer].shape[1])]
        assert all(abs(s - e) <= 0.5 + 1e-6 for s, e in zip(shown, expected, strict=True)), (shown, expected)


def test_a_text_keeps_the_first_token(runner, llama):
    folder, _ = llama
    out = invoke(runner, "head", "--model", str(folder), "--layer", "1", "--text", TEXT, "--all-heads",
                 "--all-layers", width=80).stdout
    flat = out.replace("\n", " ")
    assert " first %  value-wtd first %" in out
    assert "first %: its weight on the first token, value-wtd" in flat
    assert "weight on the first token, % (mean over queries)" in out
    assert "parks its weight on the first token but moves little" in flat


def test_the_page_names_a_tower_s_token_0(towers, tmp_path):
    from browser import browser, chromium, open_page
    from cli_main import run_main

    executable = chromium()
    assert executable is not None, "no Chromium found: the page is tested in a real browser"
    folders, picture = towers
    pages = {}
    for kind in ("vit", "siglip_vision_model"):
        pages[kind] = tmp_path / f"{kind}.html"
        assert run_main("head", "--model", str(folders[kind][0]), "--image", str(picture), "--all-layers",
                        "--html", str(pages[kind])).code == 0
    with browser(executable) as context:
        for kind, first in (("vit", "[CLS]"), ("siglip_vision_model", "p(0,0)")):
            opened = open_page(context, pages[kind])
            assert not opened.errors
            options = opened.page.locator("[data-testid=sinks-measure] option").all_inner_texts()
            assert f"weight on {first} (token 0)" in options
            assert not any("first token" in option for option in options)


# --- 3. per-layer NoPE in the interface's Q step ---------------------------------------------------------------

DECODER = {"hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 4, "num_key_value_heads": 2}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
SLIDING, FULL = "sliding_attention", "full_attention"
GRANITE_HYBRID = dict(num_hidden_layers=2, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_state=8,
                      mamba_d_head=16, mamba_chunk_size=8, num_local_experts=4, num_experts_per_tok=2,
                      shared_intermediate_size=8)
OLMO_HYBRID = dict(num_hidden_layers=2, layer_types=["linear_attention", FULL], pad_token_id=0, eos_token_id=1)
MIXED = ("cohere2", "cohere2_moe", "exaone4", "exaone_moe", "kolibri1", "flint", "afmoe", "granite_swa")  # NoPE and not


def _nope_families():
    import transformers as tf

    return {
        # sliding, sliding, sliding, full (layer_types from sliding_window_pattern 4): the full layer has no RoPE
        "cohere2": (tf.Cohere2Config, tf.Cohere2ForCausalLM, dict(num_hidden_layers=4, sliding_window=4)),
        # a dense prefix with prefix_dense_sliding_window_pattern 1: its full layer 1 turns Q and K (force_rope),
        # the sparse full layer 3 does not
        "cohere2_moe": (tf.Cohere2MoeConfig, tf.Cohere2MoeForCausalLM, dict(
            num_hidden_layers=4, sliding_window=4, layer_types=[SLIDING, FULL, SLIDING, FULL],
            mlp_layer_types=["dense", "dense", "sparse", "sparse"], prefix_dense_sliding_window_pattern=1,
            num_experts=4, num_experts_per_tok=2)),
        # sliding, full, sliding, full: "global NoPE for hybrid attention"
        "exaone4": (tf.Exaone4Config, tf.Exaone4ForCausalLM, dict(num_hidden_layers=4, sliding_window=4,
                                                                    sliding_window_pattern=2)),
        # no window at all: every layer turns Q and K
        "exaone4_full": (tf.Exaone4Config, tf.Exaone4ForCausalLM, dict(num_hidden_layers=2, sliding_window=None,
                                                                         layer_types=[FULL, FULL])),
        "exaone_moe": (tf.ExaoneMoeConfig, tf.ExaoneMoeForCausalLM, dict(
            num_hidden_layers=3, sliding_window=4, layer_types=[SLIDING, FULL, SLIDING], **MOE)),
        "kolibri1": (tf.Kolibri1Config, tf.Kolibri1ForCausalLM, dict(
            num_hidden_layers=3, sliding_window=4, layer_types=[FULL, SLIDING, FULL], head_dim=8,
            shared_expert_intermediate_size=8, **MOE)),
        "flint": (tf.FlintConfig, tf.FlintForCausalLM, dict(
            num_hidden_layers=3, sliding_window=4, layer_types=[SLIDING, FULL, SLIDING], head_dim=8,
            shared_expert_intermediate_size=8, **MOE)),
        "afmoe": (tf.AfmoeConfig, tf.AfmoeForCausalLM, dict(
            num_hidden_layers=3, sliding_window=4, layer_types=[SLIDING, FULL, SLIDING], head_dim=8, **MOE)),
        # layer_rope_theta 0: the model hands that layer no position_embeddings
        "granite_swa": (tf.GraniteSWAConfig, tf.GraniteSWAForCausalLM, dict(
            num_hidden_layers=3, sliding_window=4, layer_rope_theta=[10000.0, 0, 500.0])),
        # Granite 4.0-H: a Mamba layer, then attention with no positions (position_embedding_type None, the
        # default) or RoPE ("rope")
        "granitemoehybrid": (tf.GraniteMoeHybridConfig, tf.GraniteMoeHybridForCausalLM, GRANITE_HYBRID),
        "granitemoehybrid_rope": (tf.GraniteMoeHybridConfig, tf.GraniteMoeHybridForCausalLM,
                                  GRANITE_HYBRID | {"position_embedding_type": "rope"}),
        # OLMo Hybrid: a gated DeltaNet layer, then attention; RoPE only with a rope_theta
        "olmo_hybrid": (tf.OlmoHybridConfig, tf.OlmoHybridForCausalLM,
                        OLMO_HYBRID | {"rope_parameters": {"rope_type": "default", "rope_theta": None}}),
        "olmo_hybrid_rope": (tf.OlmoHybridConfig, tf.OlmoHybridForCausalLM, OLMO_HYBRID),
    }


def _rotated_layers(model, ids: list[int]) -> dict[int, bool]:
    """transformers' eager run: whether each attention layer's module called its modeling file's own
    `apply_rotary_pos_emb` (patched to note the module running), by layer."""
    import sys

    layers = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
    modeling = sys.modules[type(layers[0]).__module__]
    running: list[int] = []
    turned: set[int] = set()
    original = modeling.apply_rotary_pos_emb

    def noted(*args, **kwargs):
        turned.add(running[-1])
        return original(*args, **kwargs)

    hooks = [m.register_forward_pre_hook(lambda m, a: running.append(m.layer_idx)) for m in layers]
    modeling.apply_rotary_pos_emb = noted
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        modeling.apply_rotary_pos_emb = original
        for hook in hooks:
            hook.remove()
    return {m.layer_idx: m.layer_idx in turned for m in layers}


@pytest.mark.parametrize("name", [*MIXED, "exaone4_full", "granitemoehybrid", "granitemoehybrid_rope", "olmo_hybrid",
                                  "olmo_hybrid_rope"])
def test_the_q_step_says_rope_on_the_layers_that_turn_q_and_k(tmp_path, name):
    from tiny_encdec import save_random
    from tiny_models import _tokenizer

    from attnscope.models.tokenizer import encode
    from attnscope.runs.head import run_head
    from attnscope.runs.head_result import HeadOptions

    config_class, model_class, sizes = _nope_families()[name]
    tokenizer = _tokenizer("gpt2")
    config = config_class(**DECODER, vocab_size=len(tokenizer), **sizes)
    torch.manual_seed(7)
    folder = tmp_path / name
    model = save_random(model_class(config), tokenizer, folder)
    rotated = _rotated_layers(model, encode(folder, SENTENCE).ids)
    kinds = getattr(config, "layer_types", None) or [FULL] * config.num_hidden_layers
    assert sorted(rotated) == [i for i, kind in enumerate(kinds) if kind not in ("mamba", "linear_attention")]
    if name in MIXED:  # the family's NoPE layers are there, beside its rotary ones
        assert any(rotated.values()) and not all(rotated.values())
    else:
        assert all(rotated.values()) == name.endswith(("_full", "_rope")) and len(set(rotated.values())) == 1
    for layer, turned in rotated.items():
        result = run_head(HeadOptions(model=str(folder), layer=layer, head=0, text=SENTENCE))
        assert result.tracer == "attention-interface"
        op = result.run.layer.step("Q").op
        own = next(note for note in result.notes if "the steps before Q, K, V" in note)  # runs/interface.py's
        if turned:
            assert op.endswith("(its projections, norms and RoPE before: not traced)"), (layer, op)
            assert "(projections, norms, RoPE)" in own
        else:
            assert "(its projections and norms before: not traced); no RoPE in this layer (NoPE: " in op, (layer, op)
            assert "RoPE before" not in op and "(projections, norms)" in own


@pytest.mark.parametrize("name", ["llava", "gemma3"])
def test_a_long_vlm_prompt_s_image_tokens_are_no_repeat(name, tmp_path, monkeypatch):
    """The long path's statistics (blocks of rows: models/forward/long.py and vlm_long.py, Gemma 3's blocks through
    its image mask) read the image's tokens as no repeat too: head_stats' induction equals the float64 formula
    over eager output_attentions with the image's positions skipped."""
    from cli_main import run_main
    from tiny_vlm import build, image

    from attnscope.models.config import read_config
    from attnscope.models.forward import long
    from attnscope.models.vision import vlm
    from attnscope.models.vision.image import read_image

    monkeypatch.setattr(long, "LONG_TOKENS", 8)
    monkeypatch.setattr(long, "BLOCK_ROWS", 5)
    folder = tmp_path / name
    model = build(name, folder)
    picture = image(folder / "picture.png")
    out = run_main("head", "--model", str(folder), "--layer", "1", "--head", "1", "--text", TEXT, "--image",
                   str(picture), "--json")
    assert out.code == 0, out.stderr
    data = out.json()
    tokens = vlm.place(folder, read_config(folder), TEXT, read_image(picture))
    assert data["token_ids"] == tokens.ids and "attention_pooled" in data  # the long path
    with torch.no_grad():
        theirs = model(**tokens.inputs, output_attentions=True).attentions[1][0, 1]  # [n_tokens, n_tokens]
    skip = {t for t, on in enumerate(tokens.image) if on}
    expected = induction_score(theirs, tokens.ids, skip)
    assert expected is not None and expected != induction_score(theirs, tokens.ids)  # the image would count
    assert data["head_stats"]["induction"] == pytest.approx(expected, abs=1e-5)
