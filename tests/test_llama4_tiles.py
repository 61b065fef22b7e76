"""Llama 4's image processor without torchvision (attnscope/models/vision/llama4_tiles.py) held to transformers'
`Llama4ImageProcessor`, which needs torchvision: its outputs on tests/llama4_tile_cases.py's pictures and settings
were recorded by scripts/llama4_tiles_reference.py on a machine with torchvision (the file's metadata names the
versions), and attnscope's tiles must equal them bit for bit, through both of torchvision's resize paths (uint8 on
AVX2/AVX512 CPUs, float32 elsewhere). Then a tiny Llama 4 VLM with its processor_config.json saved as transformers
writes it: `head --text --image` builds Llama4Processor itself over these tiles, places the image's tokens (tiles,
then the global view) and every layer's heads equal transformers' eager output_attentions on the same inputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_main import run_main
from llama4_tile_cases import FLOAT_PATH, SETTINGS, cases, picture
from tiny_models import cached_builder
from tiny_vlm import TEXT, build, image

from attnscope.errors import UsageError
from attnscope.models.config import read_config
from attnscope.models.vision import llama4_tiles, vlm

REFERENCE = Path(__file__).parent / "references" / "llama4_tiles.safetensors"
ATOL = 1e-5


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(REFERENCE))


def test_the_reference_was_recorded_by_transformers_with_torchvision():
    from safetensors import safe_open

    with safe_open(str(REFERENCE), "pt") as opened:
        metadata = opened.metadata()
        keys = set(opened.keys())
    assert metadata["torchvision"] and metadata["transformers"].startswith("5.")
    assert keys == {f"{key}/{part}" for key, _, _ in [*cases(), *FLOAT_PATH]
                    for part in ("pixel_values", "aspect_ratios")}


@pytest.mark.parametrize(("key", "name", "setting"), cases(), ids=[key for key, _, _ in cases()])
def test_tiles_equal_llama4_image_processor(reference, key, name, setting):
    made = llama4_tiles.make(SETTINGS[setting])(images=[picture(name)], return_tensors="pt")
    theirs = reference[f"{key}/pixel_values"]
    assert made["pixel_values"].dtype == theirs.dtype and made["pixel_values"].shape == theirs.shape
    assert torch.equal(made["pixel_values"], theirs), (made["pixel_values"].float() - theirs.float()).abs().max()
    assert torch.equal(made["aspect_ratios"], reference[f"{key}/aspect_ratios"])


@pytest.mark.parametrize(("key", "name", "setting"), FLOAT_PATH, ids=[key for key, _, _ in FLOAT_PATH])
def test_tiles_equal_on_torchvisions_float32_path(reference, monkeypatch, key, name, setting):
    """A CPU without AVX2: torchvision resizes in float32 and rounds back (its reference recorded so too)."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    made = llama4_tiles.make(SETTINGS[setting])(images=[picture(name)], return_tensors="pt")
    assert torch.equal(made["pixel_values"], reference[f"{key}/pixel_values"])


def test_several_images_in_one_call(reference):
    """As Llama4ImageProcessor: every image's tiles one after another, one aspect ratio per image."""
    made = llama4_tiles.make(SETTINGS["bilinear_28x4"])(images=[picture("wide"), picture("small")],
                                                         return_tensors="pt")
    wide, small = (reference[f"{name}/bilinear_28x4/pixel_values"] for name in ("wide", "small"))
    assert torch.equal(made["pixel_values"], torch.cat([wide, small]))
    assert made["aspect_ratios"].tolist() == [[1, 3], [1, 1]]


@pytest.mark.parametrize(("settings", "said"), [
    ({"size": {"height": 28, "width": 56}}, "not a square"),
    ({"resample": 1}, "install torchvision"),
    ({"do_resize": False}, "do_resize is false"),
    ({"max_patches": 0}, "max_patches 0"),
    ({"max_patches": 10**9}, "from 1 to 256"),
    ({"max_patches": 2.5}, "max_patches 2.5"),
    ({"image_std": [0, 0, 0]}, "holds a 0"),
    ({"image_mean": "abc"}, "image_mean 'abc'"),
    ({"image_mean": [0.5] * 7}, "one number per channel"),
    ({"rescale_factor": "x"}, "rescale_factor 'x'"),
])
def test_settings_it_cannot_follow_are_one_line(settings, said):
    with pytest.raises(UsageError, match=said):
        llama4_tiles.make(settings)


# --- a tiny Llama 4 through its own processor -------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return cached_builder(tmp_path_factory, build)


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("wide") / "wide.png"
    picture("wide").save(path)
    return path


def _eager(model, inputs) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return model(**{k: v for k, v in inputs.items() if k != "aspect_ratios"}, output_attentions=True).attentions


def test_one_tile_every_layer_equals_eager(built, tmp_path):
    """A 40 x 40 picture is one tile (no global view): Llama4Processor's prompt with 4 <|patch|> tokens, the
    pixels this module cut, every layer's heads equal to eager on them."""
    from test_vlm import _every_layer

    from attnscope.models.vision.image import read_image

    folder, model = built("llama4")
    config = read_config(folder)
    tokens = vlm.place(folder, config, TEXT, read_image(image(tmp_path / "cat.png")))
    assert tokens.processor == "Llama4Processor" and tokens.grids == [(2, 2)] and tokens.whole == 0
    assert any("llama4_tiles" in note for note in tokens.notes)
    assert tokens.inputs["pixel_values"].shape == (1, 3, 56, 56)
    theirs = _eager(model, tokens.inputs)
    for L, ours in enumerate(_every_layer(folder, config, tokens, len(theirs))):
        assert torch.allclose(ours, theirs[L][0], atol=ATOL), f"layer {L}: {(ours - theirs[L][0]).abs().max()}"


def test_tiles_and_the_global_view_every_layer_equals_eager(built, wide):
    """130 x 50 is cut into 1 x 3 tiles of 56 and the global view: four runs of 4 image tokens, separated as
    Llama4Processor's _prompt_split_image separates them; the picture is the last run's (the whole image)."""
    from test_vlm import _every_layer

    from attnscope.models.vision.image import read_image

    folder, model = built("llama4")
    config = read_config(folder)
    tokens = vlm.place(folder, config, TEXT, read_image(wide))
    assert tokens.inputs["pixel_values"].shape == (4, 3, 56, 56)  # 1 x 3 tiles, then the global view
    assert tokens.grids == [(2, 2)] * 4 and tokens.whole == 3
    placed = tokens.labels[tokens.run_start(0) - 1:tokens.run_start(1) + 1]
    assert placed[0] == "<|image_start|>" and placed[5] == "<|tile_x_separator|>" and placed[6] == "img2(0,0)"
    theirs = _eager(model, tokens.inputs)
    for L, ours in enumerate(_every_layer(folder, config, tokens, len(theirs))):
        assert torch.allclose(ours, theirs[L][0], atol=ATOL), f"layer {L}: {(ours - theirs[L][0]).abs().max()}"


def test_command_line_and_check(built, wide):
    folder, _ = built("llama4")
    out = run_main("head", "--model", str(folder), "--text", TEXT, "--image", str(wide), "--layer", "1",
                   "--check", "--json")
    assert out.code == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["check_passed"] and any("llama4_tiles" in note for note in data["notes"])


def test_a_folder_without_its_image_settings_is_one_line(built, wide, tmp_path):
    folder, _ = built("llama4")
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / "processor_config.json").unlink()
    out = run_main("head", "--model", str(bare), "--text", TEXT, "--image", str(wide))
    assert out.code == 2 and len(out.error_lines) == 1 and "no image processor settings" in out.stderr, out.stderr


def test_settings_that_are_not_an_object_are_one_line(built, wide, tmp_path):
    folder, _ = built("llama4")
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "processor_config.json").write_text("[1, 2]")
    out = run_main("head", "--model", str(broken), "--text", TEXT, "--image", str(wide))
    assert out.code == 2 and len(out.error_lines) == 1 and "holds a JSON list" in out.stderr, out.stderr
    assert "save_pretrained" in out.stderr


def test_settings_in_preprocessor_config_json(built, wide, tmp_path):
    """Checkpoints saved before transformers 5 keep the image processor's settings in preprocessor_config.json
    (Llama-4-Scout's names Llama4ImageProcessorFast): read from there, the same tiles."""
    folder, _ = built("llama4")
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    settings = json.loads((old / "processor_config.json").read_text())
    images = {**settings.pop("image_processor"), "image_processor_type": "Llama4ImageProcessorFast"}
    (old / "processor_config.json").write_text(json.dumps(settings))
    (old / "preprocessor_config.json").write_text(json.dumps(images))
    from attnscope.models.vision.image import read_image

    new, old_tokens = (vlm.place(f, read_config(f), TEXT, read_image(wide)) for f in (folder, old))
    assert new.ids == old_tokens.ids
    assert torch.equal(new.inputs["pixel_values"], old_tokens.inputs["pixel_values"])


def test_any_size_and_setting_cuts_whole_tiles():
    """Any picture (1 x 1 to 400 x 400, any aspect) under any tile side and count: rows * cols <= max_patches tiles
    of the side, the global view only where there are several, aspect_ratios (rows, cols), and the padding
    (the canvas right and below the resized image) is normalized black: (0 - mean) / std."""
    from fuzz import fuzz_settings
    from hypothesis import given
    from hypothesis import strategies as st
    from PIL import Image

    @fuzz_settings(40)
    @given(st.integers(1, 400), st.integers(1, 400), st.sampled_from([14, 28]), st.integers(1, 8),
           st.booleans(), st.sampled_from([0, 2, 3]))
    def cut(width, height, side, max_patches, to_max, resample):
        picture = Image.new("RGB", (width, height), (255, 255, 255))
        made = llama4_tiles.make({"size": {"height": side, "width": side}, "max_patches": max_patches,
                                  "resize_to_max_canvas": to_max, "resample": resample})(images=[picture],
                                                                                         return_tensors="pt")
        rows, cols = made["aspect_ratios"][0].tolist()
        assert 1 <= rows * cols <= max_patches
        n_tiles = rows * cols + (1 if rows * cols > 1 else 0)
        assert made["pixel_values"].shape == (n_tiles, 3, side, side)
        values = made["pixel_values"].float()
        assert torch.isfinite(values).all() and values.min() >= -1 and values.max() <= 1
        assert values[-1].max() == 1  # the last tile (or the only one) holds white pixels
    cut()
