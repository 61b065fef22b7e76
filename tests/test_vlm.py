"""Vision-language models with --text and --image (models/vision/vlm*.py, runs/vlm.py): a tiny random VLM per
family with its processor saved beside it (tests/tiny_vlm.py), a test image drawn here; the image's tokens where
the model's processor puts them, labelled img(r,c), and every layer's heads equal to transformers' eager
output_attentions of the full VLM, Gemma 3's bidirectional image block included; each text query's share of
weight on the image against a float64 sum of eager's pattern; the command line's output and its refusals."""

from __future__ import annotations

import pytest
import torch
from cli_main import run_main
from tiny_models import cached_builder
from tiny_vlm import TEXT, build, eager_attentions, image

from attnscope.models.config import read_config
from attnscope.models.vision import vlm, vlm_run
from attnscope.models.vision.image import read_image

ATOL = 1e-5
PROCESSED = ("gemma3", "llava", "llava_mistral", "qwen2_5_vl", "qwen3_vl")  # Llama 4: tests/test_llama4_tiles.py


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    return image(tmp_path_factory.mktemp("picture") / "cat.png")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return cached_builder(tmp_path_factory, build)


def _every_layer(folder, config, tokens, n_layer: int) -> list[torch.Tensor]:
    """attnscope's every layer's heads `[n_head, n_tokens, n_tokens]`: the family page's run from the model's
    embeddings (every layer in one pass, and layer L alone for each L: both must agree), or the attention
    interface's record of every layer."""
    from attnscope.models.forward.run import run_layer
    from attnscope.models.forward.stream import every_layer

    if vlm.VLM_TYPES[config.model_type] is None:
        run, patterns = vlm_run.interface(folder, config, tokens, n_layer - 1, every=True)
        assert patterns is not None and torch.equal(patterns[-1], run.attention)
        return patterns
    model = vlm_run.text_family(folder, config, tokens)
    zeros = [0] * len(tokens.ids)
    patterns = every_layer(model, tokens.ids, zeros, 0, 0).patterns
    for L, pattern in enumerate(patterns):
        alone = run_layer(model, tokens.ids, zeros, L, 0).layer["attention"][0]
        assert torch.allclose(alone, pattern, atol=1e-6), L
    return patterns


@pytest.mark.parametrize("name", PROCESSED)
def test_every_layer_equals_eager(name, built, picture):
    folder, model = built(name)
    ids, theirs = eager_attentions(model, folder, TEXT, picture)
    config = read_config(folder)
    tokens = vlm.place(folder, config, TEXT, read_image(picture))
    assert tokens.ids == ids  # the processor's own placement
    assert tokens.grids == [(2, 2)] and tokens.n_image == 4
    first = tokens.image.index(True)
    assert tokens.labels[first:first + 4] == ["img(0,0)", "img(0,1)", "img(1,0)", "img(1,1)"]
    assert not any(label.startswith("img") for label, on in zip(tokens.labels, tokens.image, strict=True) if not on)
    for L, ours in enumerate(_every_layer(folder, config, tokens, len(theirs))):
        reference = theirs[L][0]  # [n_head, n_tokens, n_tokens]
        assert ours.shape == reference.shape
        assert torch.allclose(ours, reference, atol=ATOL), f"{name} layer {L}: {(ours - reference).abs().max()}"


def test_gemma3_image_block_sees_both_ways(built, picture):
    """In Gemma 3 an image token attends to the image's later tokens (eager does too), a text token never to a
    later one; and the mask is transformers' own, create_masks_for_vision_model's, on every layer type."""
    from transformers.models.gemma3.modeling_gemma3 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    from attnscope.models.vision.vlm_gemma3 import image_mask

    folder, model = built("gemma3")
    _, theirs = eager_attentions(model, folder, TEXT, picture)
    tokens = vlm.place(folder, read_config(folder), TEXT, read_image(picture))
    first = tokens.image.index(True)
    assert float(theirs[2][0][:, first, first + 3].min()) > 0  # img(0,0) sees img(1,1), after it
    types = torch.tensor([tokens.image], dtype=torch.long)
    text_config = model.config.get_text_config()
    embeds = torch.zeros(1, len(tokens.ids), text_config.hidden_size)
    masks = create_masks_for_vision_model(text_config, embeds, None, None, None,
                                          get_block_sequence_ids_for_mask(types))
    for kind, window in (("full_attention", None), ("sliding_attention", text_config.sliding_window)):
        reference = masks[kind][0, 0]
        reference = reference if reference.dtype == torch.bool else reference == 0
        assert torch.equal(image_mask(tokens.blocks(), window), reference), kind


def test_image_share_is_the_rows_sum_over_the_image(built, picture):
    folder, model = built("llava")
    _, theirs = eager_attentions(model, folder, TEXT, picture)
    tokens = vlm.place(folder, read_config(folder), TEXT, read_image(picture))
    pattern = theirs[1][0].double()  # [n_head, n_tokens, n_tokens]
    expected = torch.stack([pattern[:, :, k] for k, on in enumerate(tokens.image) if on], dim=-1).sum(-1)
    assert torch.allclose(vlm.image_share(pattern, tokens.image), expected, atol=1e-12)


@pytest.mark.parametrize("name", ["gemma3", "qwen2_5_vl"])
def test_command_line_json_and_check(name, built, picture):
    folder, _ = built(name)
    out = run_main("head", "--model", str(folder), "--layer", "1", "--head", "1", "--text", TEXT, "--image",
                   str(picture), "--check", "--json")
    assert out.code == 0, out.stderr
    data = out.json()
    assert data["check_passed"] is True
    first = data["image_tokens"][0]
    assert data["image_tokens"] == list(range(first, first + 4)) and data["image_grids"] == [[2, 2]]
    assert data["tokens"][first:first + 4] == ["img(0,0)", "img(0,1)", "img(1,0)", "img(1,1)"]
    share = torch.tensor(data["image_share"])  # [n_head, n_tokens]
    pattern = torch.tensor(data["attention"])  # head 1's [n_tokens, n_tokens]
    assert torch.allclose(share[1], pattern[:, first:first + 4].sum(-1), atol=1e-6)
    assert data["tracer"] == ("attnscope" if name == "gemma3" else "attention-interface")


def test_terminal_table(built, picture):
    folder, _ = built("llava")
    out = run_main("head", "--model", str(folder), "--layer", "1", "--text", TEXT, "--image", str(picture))
    assert out.code == 0, out.stderr
    assert "each text query's weight on the image's 4 tokens" in out.stdout
    assert "img(1,1)" in out.stdout and "mean of heads" in out.stdout
    assert max(len(line) for line in out.stdout.splitlines()) <= 80


def test_refusals(built, picture, tmp_path):
    folder, _ = built("llava")
    not_image = tmp_path / "notes.png"
    not_image.write_text("not a picture")
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(picture.read_bytes()[:200])
    cases = [
        (["--image", str(not_image), "--text", TEXT], "is not an image"),
        (["--image", str(truncated), "--text", TEXT], "is truncated"),
        (["--image", str(picture)], "add --text"),
        (["--image", str(picture), "--text", TEXT, "--generate", "5000"], "--generate 5000: give how many"),
        (["--image", str(picture), "--text", TEXT, "--layer", "5"], "--layer 5 is out of range"),
        (["--image", str(picture), "--text", TEXT, "--head", "4"], "--head 4 is out of range"),
    ]
    for args, said in cases:
        out = run_main("head", "--model", str(folder), *args)
        assert out.code == 2 and len(out.error_lines) == 1 and said in out.stderr, (args, out.stderr)
    out = run_main("head", "--model", str(folder), "--text", TEXT, "--image", str(picture), "--max-memory", "10KB")
    assert out.code == 1 and len(out.error_lines) == 1 and "more than --max-memory" in out.stderr, out.stderr


def test_a_text_model_refuses_an_image(tmp_path, picture):
    from tiny_models import build as build_text

    build_text("llama", tmp_path / "llama")
    out = run_main("head", "--model", str(tmp_path / "llama"), "--text", TEXT, "--image", str(picture))
    assert out.code == 2 and len(out.error_lines) == 1 and "vision-language" in out.stderr, out.stderr
    alone = run_main("head", "--model", str(tmp_path / "llama"), "--image", str(picture))  # no --text to drop
    assert alone.code == 2 and len(alone.error_lines) == 1 and "reads no image: drop --image" in alone.stderr


def test_python_api_and_notebook(built, picture):
    import attnscope

    folder, model = built("llava")
    result = attnscope.model_head(folder, 1, 3, text=TEXT, image=picture)
    _, theirs = eager_attentions(model, folder, TEXT, picture)
    assert torch.allclose(result.attention, theirs[1][0, 3], atol=ATOL)
    assert result.image_share is not None and result.image_share.shape == result.all_heads.shape[:2]
    assert result.picture is not None and (result.picture.grid.rows, result.picture.grid.cols) == (2, 2)
    assert "img(0,0)" in result._repr_html_()


def test_chat_template_places_the_image(built, picture, tmp_path):
    """A processor with a chat template: the text goes into a user turn after the image, as the template puts it,
    and the ids are the processor's own on that prompt."""
    import shutil

    from transformers import AutoProcessor

    folder, _ = built("llava")
    copy = tmp_path / "llava-chat"
    shutil.copytree(folder, copy)
    processor = AutoProcessor.from_pretrained(copy)
    processor.chat_template = ("{{ bos_token }}{% for m in messages %}USER: {% for c in m['content'] %}"
                               "{% if c['type'] == 'image' %}"
                               "<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}"
                               "{% if add_generation_prompt %} ASSISTANT:{% endif %}")
    processor.save_pretrained(copy)
    tokens = vlm.place(copy, read_config(copy), TEXT, read_image(picture))
    assert tokens.prompt == f"<s>USER: <image>\n{TEXT} ASSISTANT:"
    # the template's BOS and no second one, as ProcessorMixin.apply_chat_template(tokenize=True) does
    expected = processor(text=tokens.prompt, images=[read_image(picture)], return_tensors="pt",
                         add_special_tokens=False)["input_ids"][0]
    assert tokens.ids == expected.tolist() and tokens.n_image == 4
    assert tokens.ids.count(processor.tokenizer.bos_token_id) == 1


def test_text_settings_fill_what_config_json_leaves_out(tmp_path):
    """LLaVA 1.5's config.json names a few text settings (the rest are LlamaConfig's defaults), and an older
    Qwen2.5-VL's keeps them at the top level: the language model's layers are read as transformers reads them."""
    import json

    from attnscope.models.config import Config

    for name, saved, layers in (
            ("llava", {"model_type": "llava", "text_config": {"model_type": "llama", "vocab_size": 32064,
                                                              "rms_norm_eps": 1e-5}}, 32),
            ("qwen2_5_vl", {"model_type": "qwen2_5_vl", "hidden_size": 64, "num_hidden_layers": 7,
                            "num_attention_heads": 4, "num_key_value_heads": 2}, 7)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(saved))
        config = Config(folder / "config.json", saved)
        assert vlm_run.text_settings(folder, config)["num_hidden_layers"] == layers, name


@pytest.mark.parametrize("name", ["llava_mistral", "qwen3_vl"])
def test_all_layers_with_check(name, built, picture):
    """--all-layers with an image: every layer's heads and kinds, each layer held against eager by --check."""
    folder, model = built(name)
    out = run_main("head", "--model", str(folder), "--layer", "0", "--text", TEXT, "--image", str(picture),
                   "--all-layers", "--check", "--json")
    assert out.code == 0, out.stderr
    data = out.json()
    _, theirs = eager_attentions(model, folder, TEXT, picture)
    assert [c["name"] for c in data["check"]] == [f"layer {i}" for i in range(len(theirs))] and data["check_passed"]
    for i, layer in enumerate(data["all_layers"]):
        assert torch.allclose(torch.tensor(layer["attention"]), theirs[i][0], atol=ATOL)


def test_tiles_are_runs_and_the_global_view_is_drawn(built):
    """Llama4Processor's prompt for a 2 x 1 tiling: two tiles, separated, then the global view; each run its own
    labels, and the picture's run is the last (the whole image)."""
    import transformers as tf
    from transformers import AutoTokenizer

    folder, _ = built("llama4")
    prompt = tf.Llama4Processor._prompt_split_image(None, (2, 1), 4) + TEXT
    tokenizer = AutoTokenizer.from_pretrained(folder)
    inputs = dict(tokenizer(prompt, return_tensors="pt"))
    tokens = vlm.found(read_config(folder), inputs, tokenizer, prompt, "by hand")
    assert tokens.grids == [(2, 2)] * 3 and tokens.whole == 2
    labelled = [label for label in tokens.labels if label.startswith("img")]
    assert labelled[:5] == ["img(0,0)", "img(0,1)", "img(1,0)", "img(1,1)", "img2(0,0)"]
    assert labelled[-1] == "img3(1,1)" and tokens.labels[tokens.run_start(2)] == "img3(0,0)"
