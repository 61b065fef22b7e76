"""Issue 43's images and vision towers (items 4, 18 to 22): thin images refused before the processor's resize
blows them up, 16-bit PNGs read as the picture they are, transparency converted as each processor converts it,
SigLIP2 named as a family not supported, what each head of a tower moves, and the `moved` legend's wording.
Each against a reference that shares no attnscope code: transformers' processors, helpers and eager towers
(`output_attentions`, the value and output projections' own weights), or a float64 formula.
"""

from __future__ import annotations

import resource
import time

import numpy as np
import pytest
import torch
from cli_main import INTERNAL, assert_usage_error, run_main
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import cached_builder
from tiny_vision import build, draw

from attnscope.errors import UsageError

TOWERS = ("vit", "deit", "dinov2", "clip", "siglip")


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    return cached_builder(tmp_path_factory, build)


def _rgba(path, width: int = 48, height: int = 40):
    """A picture with real transparency: an alpha ramp from clear (top) to opaque (bottom) over colours that
    differ from pixel to pixel, so that dropping the alpha shows what lies under the clear part."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    array = np.stack([(x * 5) % 256, (y * 6) % 256, ((x + y) * 3) % 256,
                      np.clip(y * 255 // (height - 1), 0, 255)], axis=-1).astype(np.uint8)
    Image.fromarray(array, "RGBA").save(path)
    return path


def _reference_pixels(folder, picture) -> torch.Tensor:
    """transformers' own processor on the PIL picture: converted by the processor where it converts
    (`do_convert_rgb`), else by transformers' convert_to_rgb (ViT's and DeiT's read three channels only)."""
    from transformers import AutoImageProcessor
    from transformers.image_transforms import convert_to_rgb

    processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
    if not getattr(processor, "do_convert_rgb", False):
        picture = convert_to_rgb(picture, return_numpy=True)
    return processor(images=picture, return_tensors="pt")["pixel_values"]


def _eager(tower, pixels: torch.Tensor, layer: int):
    """Layer `layer`'s eager pattern `[n_head, n, n]` and its values as the value projection made them
    `[n, n_head·d_head]`, with the layer's output projection's weight, from transformers' own modules."""
    captured = {}
    modules = dict(tower.named_modules())

    def linear(*names: str) -> torch.nn.Linear:
        found = [m for n, m in modules.items() if n.endswith(tuple(f".{layer}.{name}" for name in names))]
        assert len(found) == 1, names
        return found[0]

    value = linear("attention.v_proj", "self_attn.v_proj")
    out = linear("attention.o_proj", "self_attn.out_proj")
    hook = value.register_forward_hook(lambda _m, _i, o: captured.setdefault("v", o))
    with torch.no_grad():
        pattern = tower(pixel_values=pixels, output_attentions=True).attentions[layer][0]
    hook.remove()
    return pattern, captured["v"][0], out.weight


def _moved_reference(pattern, values, W_O):
    """Kobayashi et al.'s ||f_h(x_j)||, `(x_j W_V^h + b_V^h) W_O^h`, and each head's mean over queries of
    Σ_j a_ij ||f_h(x_j)||, in float64 loops over heads."""
    n_head = pattern.shape[0]
    d_head = values.shape[-1] // n_head
    norms, moved = [], []
    for h in range(n_head):
        f = values[:, h * d_head:(h + 1) * d_head].double() @ W_O.detach()[:, h * d_head:(h + 1) * d_head].double().T
        norm = f.norm(dim=-1)  # [n]
        norms.append(norm)
        moved.append(float((pattern[h].double() * norm[None]).sum(dim=-1).mean()))
    return torch.stack(norms), moved


# --- item 19: transparency, and item 21: what each head of a tower moves ------------------------------------


@pytest.mark.parametrize("kind", TOWERS)
def test_transparent_image_as_the_processor_reads_it_and_what_each_head_moves(towers, tmp_path, kind):
    """An RGBA picture with real transparency: every head equal to transformers' eager tower on the processor's
    own conversion (CLIP's, SigLIP's and DINOv2's composite it on white), not on the picture with its alpha
    dropped (which differs); and the tower's `moved` table filled, equal to a float64 reference from its own
    value and output projections."""
    from PIL import Image

    from attnscope.runs.head import run_head
    from attnscope.runs.head_result import HeadOptions

    folder, tower = towers(kind)
    path = _rgba(tmp_path / "clear.png")
    result = run_head(HeadOptions(model=str(folder), layer=1, head=2, image=str(path), all_heads=True))
    theirs, values, W_O = _eager(tower, _reference_pixels(folder, Image.open(path)), 1)
    torch.testing.assert_close(result.all_heads, theirs, atol=1e-5, rtol=0)
    dropped, _, _ = _eager(tower, _reference_pixels(folder, Image.open(path).convert("RGB")), 1)
    assert (result.all_heads - dropped).abs().max() > 1e-3  # the alpha matters: the test can tell the two apart
    norms, moved = _moved_reference(theirs, values, W_O)
    assert result.value_norms is not None, "a tower's heads must say what they move"
    torch.testing.assert_close(result.value_norms, norms, atol=1e-5, rtol=1e-5)
    assert result.heads is not None
    np.testing.assert_allclose(result.heads.moved(), moved, rtol=1e-5)


def test_tower_moved_table_and_legend_in_the_terminal(towers, tmp_path):
    """Item 21: the terminal's `what each head moves` table of a tower shows numbers, not dashes; item 22: its
    legend calls `moved` an upper bound, as docs/heads.md and the page do."""
    from pathlib import Path

    folder, _ = towers("clip")
    picture = draw(tmp_path / "cat.png")
    got = run_main("head", "--model", str(folder), "--image", str(picture), "--all-heads")
    assert got.code == 0, got.stderr
    table = got.stdout.split("what each head moves")[1]
    rows = [line.split() for line in table.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 4 and all(row[1] != "-" and float(row[1]) > 0 for row in rows), table
    assert "upper bound" in " ".join(table.split()) and "what the head adds to the residual stream;" not in table
    root = Path(__file__).resolve().parent.parent
    assert "upper bound" in (root / "docs" / "heads.md").read_text()
    assert "upper bound" in (root / "attnscope" / "views" / "assets" / "explorer.html").read_text()


def test_moved_unknown_says_why():
    """Item 21: where no values are known (a trace that fell back to eager's pattern alone), the table's dashes
    come with a line saying why."""
    from rich.console import Console

    from attnscope.readings.headstats import LayerHeads
    from attnscope.render.readings import show_moved

    pattern = torch.softmax(torch.randn(2, 3, 3), dim=-1)
    heads = LayerHeads("layer 0", pattern, ["a", "b", "c"], ["a", "b", "c"], heads=[{"head": 0}, {"head": 1}])
    console = Console(width=80, record=True, force_terminal=False)
    show_moved(console, heads)
    text = " ".join(console.export_text().split())
    assert "moved and value-wtd are '-'" in text and "no traced values" in text


def test_palette_and_grey_transparency_as_the_processor_reads_it(towers, tmp_path):
    """A palette picture with a transparent index (tRNS) and a grey with alpha (LA): CLIP's processor composites
    both on white; attnscope hands it the picture as it is."""
    from PIL import Image

    from attnscope.models.vision.image import read_image
    from attnscope.models.vision.processor import pixel_values

    folder, _ = towers("clip")
    rgba = Image.open(_rgba(tmp_path / "clear.png"))
    palette = rgba.convert("RGB").quantize(16)
    palette.info["transparency"] = 3
    palette.save(tmp_path / "palette.png", transparency=3)
    rgba.convert("LA").save(tmp_path / "grey.png")
    for name in ("palette.png", "grey.png"):
        mine = pixel_values(folder, read_image(tmp_path / name)).values
        torch.testing.assert_close(mine, _reference_pixels(folder, Image.open(tmp_path / name)), atol=0, rtol=0)


def test_vlm_gets_the_picture_with_its_transparency(tmp_path):
    """A VLM (LLaVA, CLIP's processor): the processor's pixel_values from attnscope's placement equal
    transformers' AutoProcessor's on the RGBA file (composited on white), not the alpha-dropped picture's."""
    from PIL import Image
    from tiny_vlm import TEXT
    from tiny_vlm import build as build_vlm
    from transformers import AutoProcessor

    from attnscope.models.config import read_config
    from attnscope.models.vision import vlm
    from attnscope.models.vision.image import read_image

    folder = tmp_path / "llava"
    build_vlm("llava", folder)
    path = _rgba(tmp_path / "clear.png")
    tokens = vlm.place(folder, read_config(folder), TEXT, read_image(path), str(path))
    processor = AutoProcessor.from_pretrained(folder)
    theirs = processor.image_processor(images=Image.open(path), return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(tokens.inputs["pixel_values"].float(), theirs.float(), atol=0, rtol=0)
    dropped = processor.image_processor(images=Image.open(path).convert("RGB"), return_tensors="pt")["pixel_values"]
    assert (theirs - dropped).abs().max() > 0.1
    thin = tmp_path / "thin.png"
    Image.new("RGB", (100_000, 1), (90, 40, 20)).save(thin)
    with pytest.raises(UsageError, match=r"100,000 x 1 pixels.*would make it.*crop it"):
        vlm.place(folder, read_config(folder), TEXT, read_image(thin), str(thin))


# --- item 18: 16-bit PNGs -----------------------------------------------------------------------------------


def test_sixteen_bit_png_read_as_the_picture_it_is(towers, tmp_path):
    """A 16-bit grey PNG written by Pillow (mode I;16): read as its high byte (v >> 8, as Pillow reads a 16-bit
    colour PNG), not clipped to white by Pillow's convert; every head equal to the eager tower on that 8-bit
    picture, and a transparent grey (tRNS) composited as CLIP's processor composites an 8-bit one."""
    from PIL import Image

    from attnscope.models.vision.image import read_image
    from attnscope.runs.head import run_head
    from attnscope.runs.head_result import HeadOptions

    folder, tower = towers("vit")
    y, x = np.mgrid[0:40, 0:48]
    deep = np.minimum(x * 1300 + y * 150, 65535).astype(np.uint16)
    path = tmp_path / "deep.png"
    Image.fromarray(deep).save(path)
    assert Image.open(path).mode == "I;16"
    eight = Image.fromarray((deep // 256).astype(np.uint8), "L")
    assert np.asarray(read_image(path)).tolist() == np.asarray(eight).tolist()
    result = run_head(HeadOptions(model=str(folder), layer=1, head=0, image=str(path), all_heads=True))
    theirs, _, _ = _eager(tower, _reference_pixels(folder, eight), 1)
    torch.testing.assert_close(result.all_heads, theirs, atol=1e-5, rtol=0)
    assert result.picture is not None and np.asarray(result.picture.image).min() < 200  # not white

    clip_folder, _ = towers("clip")
    from attnscope.models.vision.processor import pixel_values

    keyed = tmp_path / "keyed.png"
    Image.fromarray(deep).save(keyed, transparency=int(deep[5, 7]))
    alpha = np.where(deep == deep[5, 7], 0, 255).astype(np.uint8)
    reference = Image.merge("LA", (eight, Image.fromarray(alpha, "L")))
    torch.testing.assert_close(pixel_values(clip_folder, read_image(keyed)).values,
                               _reference_pixels(clip_folder, reference), atol=0, rtol=0)


@pytest.mark.parametrize(("mode", "words"), [("I", "32-bit integer samples"), ("F", "32-bit floating-point")])
def test_wide_samples_refused_in_one_message(towers, tmp_path, mode, words):
    """32-bit TIFFs (Pillow's I and F) have no one scale to read them by: one message, exit 2."""
    from PIL import Image

    folder, _ = towers("vit")
    path = tmp_path / "wide.tiff"
    Image.new(mode, (40, 30), 70000 if mode == "I" else 0.5).save(path)
    assert_usage_error(run_main("head", "--model", str(folder), "--image", str(path)), words, "8- or 16-bit PNG")


# --- item 4: thin images --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "size", "words"), [
    ("clip", (2_000_000, 1), ("2,000,000 x 1 pixels", "64,000,000 x 32 = 2,048,000,000 pixels")),
    ("dinov2", (1, 100_000), ("1 x 100,000 pixels", "32 x 3,200,000")),
])
def test_thin_image_refused_before_the_resize(towers, tmp_path, kind, size, words):
    """A shortest-edge processor would scale a thin image up to GiBs: refused before any resize, in one message
    naming the image and the size it would make, in little memory and time."""
    from PIL import Image

    folder, _ = towers(kind)
    path = tmp_path / "thin.png"
    Image.new("RGB", size, (90, 40, 20)).save(path)
    before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.process_time()
    got = run_main("head", "--model", str(folder), "--image", str(path))
    assert_usage_error(got, str(path), *words, "crop it")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 400 * 1024  # KiB: under 400 MiB more
    assert time.process_time() - start < 5


def test_thin_image_to_a_fixed_size_runs(towers, tmp_path):
    """A processor that resizes to a fixed size (ViT's) makes 32 x 32 of a 100,000 x 1 image: no refusal."""
    from PIL import Image

    folder, _ = towers("vit")
    path = tmp_path / "thin.png"
    Image.new("RGB", (100_000, 1), (90, 40, 20)).save(path)
    got = run_main("head", "--model", str(folder), "--image", str(path))
    assert got.code == 0, got.stderr


def test_out_of_memory_advice_names_only_flags_the_command_has(towers, tmp_path, monkeypatch):
    """`head` has no --meta: its out-of-memory line names what it has; sdpa's still names --meta."""
    import attnscope.runs.head as head

    def fail(*_args, **_kwargs):
        raise MemoryError

    monkeypatch.setattr(head, "run_head", fail)
    folder, _ = towers("vit")
    got = run_main("head", "--model", str(folder), "--image", str(draw(tmp_path / "cat.png")))
    assert got.code == 1 and "out of memory" in got.stderr and "--meta" not in got.stderr, got.stderr
    assert "--layer" in got.stderr and "--image" in got.stderr
    import attnscope.runs.sdpa as sdpa

    monkeypatch.setattr(sdpa, "run_sdpa", fail)
    got = run_main("sdpa", "--nq", "4")
    assert got.code == 1 and "--meta" in got.stderr, got.stderr


def _processors():
    import transformers as t

    square = {"height": 32, "width": 32}
    return {
        "shortest_edge": t.CLIPImageProcessorPil(size={"shortest_edge": 32}, do_center_crop=False),
        "shortest_and_longest": t.CLIPImageProcessorPil(size={"shortest_edge": 24, "longest_edge": 64},
                                                        do_center_crop=False),
        "max_height_width": t.CLIPImageProcessorPil(size={"max_height": 40, "max_width": 56}, do_center_crop=False),
        "height_width": t.ViTImageProcessorPil(size=square),
        "qwen_smart_resize": t.Qwen2VLImageProcessorPil(size={"shortest_edge": 28 * 28 * 4,
                                                              "longest_edge": 28 * 28 * 16}),
    }


@fuzz_settings(15)
@given(st.integers(1, 260), st.integers(1, 260), st.sampled_from(sorted(_processors())))
def test_planned_size_is_the_size_the_processor_makes(width, height, kind):
    """planned_size, computed without resizing, equals the size transformers' processor then makes (Qwen: its
    image_grid_thw times the patch size), for each way a size dict can say it."""
    from PIL import Image

    from attnscope.models.vision.processor import planned_size

    processor = _processors()[kind]
    picture = Image.new("RGB", (width, height), (120, 60, 30))
    try:
        planned = planned_size(processor, height, width)
    except ValueError as exc:  # smart_resize's aspect ratio over 200: the processor raises the same
        with pytest.raises(ValueError, match="aspect ratio"):
            processor(images=picture, return_tensors="pt")
        assert "aspect ratio" in str(exc)
        return
    assert planned is not None
    if min(planned[:2]) < 1:  # nothing left of a thin picture (max_height/max_width): the processor fails on it
        with pytest.raises(ValueError):
            processor(images=picture, return_tensors="pt")
        return
    made = processor(images=picture, return_tensors="pt")
    if "image_grid_thw" in made:
        _, rows, cols = (int(v) for v in made["image_grid_thw"][0])
        got = (rows * processor.patch_size, cols * processor.patch_size)
    else:
        got = tuple(made["pixel_values"].shape[-2:])
    assert planned[:2] == got


# --- item 20: SigLIP2 -----------------------------------------------------------------------------------------


def test_siglip2_named_as_not_supported(tmp_path):
    """A SigLIP2 reads images: its refusal says attnscope does not support the family (and what it supports), not
    that the model reads no image; a text model still hears that it reads none."""
    import transformers as t

    folder = tmp_path / "siglip2"
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24, patch_size=8,
                  num_patches=16)
    text = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    t.Siglip2Model(t.Siglip2Config(text_config=text, vision_config=vision)).save_pretrained(folder)
    picture = draw(tmp_path / "cat.png")
    for more in ([], ["--text", "a cat"]):
        got = run_main("head", "--model", str(folder), "--image", str(picture), *more)
        assert_usage_error(got, "model_type 'siglip2'", "does not support", "vision towers (vit", "siglip")
        assert "reads no image" not in got.stderr and "drop --image" not in got.stderr


# --- a little fuzzing of the image surface --------------------------------------------------------------------

MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "CMYK", "YCbCr", "I;16", "I;16B", "I", "F")


@fuzz_settings(12)
@given(st.one_of(st.integers(1, 2000), st.integers(2000, 300_000)), st.integers(1, 64), st.sampled_from(MODES),
       st.sampled_from(("PNG", "TIFF", "WEBP", "BMP", "GIF", "JPEG")), st.booleans(), st.integers(0, 2**16 - 1),
       st.sampled_from(sorted(_processors())))
def test_fuzzed_images_read_or_refused(tmp_path_factory, long, short, mode, fmt, flip, value, kind):
    """Random sizes (thin ones too), modes, bit depths and values through every format Pillow writes them in:
    made into finite pixel values by each kind of processor or refused in one message, never another error, each
    within 5 s of CPU and 1 GiB more memory."""
    from PIL import Image

    from attnscope.models.vision.image import read_image
    from attnscope.models.vision.processor import as_processor_reads, check_size

    short = short if long <= 5000 else min(short, 3)  # a thin picture: files of a few MB at most
    width, height = (long, short) if flip else (short, long)
    folder = tmp_path_factory.mktemp("fuzz")
    path = folder / f"picture.{fmt.lower()}"
    fill = value / 65535 if mode == "F" else value if mode.startswith("I") else value % 256
    try:
        Image.new(mode, (width, height), fill if mode not in ("RGB", "RGBA", "CMYK", "YCbCr") else None).save(
            path, format=fmt)
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return  # Pillow writes no such file (a GIF past 65,535 pixels a side, a JPEG of 16-bit samples, ...)
    processor = _processors()[kind]
    start, memory = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        picture = read_image(path)
        check_size(processor, picture.width, picture.height, str(path))
        values = processor(images=as_processor_reads(processor, picture), return_tensors="pt")["pixel_values"]
        assert torch.isfinite(torch.as_tensor(values)).all()
    except UsageError as exc:
        assert "\n" not in str(exc) and INTERNAL not in str(exc)
    assert time.process_time() - start < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - memory < 1024 * 1024  # KiB: 1 GiB
    assert [p.name for p in folder.iterdir()] == [path.name]  # read, nothing written beside it


@pytest.mark.parametrize(("size", "words"), [
    ({"shortest_edge": -5}, ("an empty image", "fix the size in preprocessor_config.json")),
    ({"height": 10**9, "width": 10**9}, ("about 10^18 pixels", "fix the size in preprocessor_config.json")),
    ({"shortest_edge": 1e300}, ("about 10^", "fix the size in preprocessor_config.json")),
    ({"shortest_edge": "abc"}, ("cannot work out the size", "fix the size in preprocessor_config.json")),
])
def test_processor_sizes_that_cannot_be_made_refused(towers, tmp_path, size, words):
    """A preprocessor_config.json whose size no resize can make: one message naming the size, exit 2, before any
    pixel is resized (a square picture would fail the same way, so the advice is the config's, not the shape's)."""
    import json
    import shutil

    folder, _ = towers("clip")
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    settings = json.loads((bad / "preprocessor_config.json").read_text())
    (bad / "preprocessor_config.json").write_text(json.dumps({**settings, "size": size, "do_center_crop": False}))
    assert_usage_error(run_main("head", "--model", str(bad), "--image", str(draw(tmp_path / "cat.png"))), *words)


@pytest.mark.parametrize("kind", ["vit", "siglip"])
def test_every_layer_of_a_tower_says_what_its_heads_move(towers, tmp_path, kind):
    """Item 21 with --all-layers: each layer's value_norms equal the float64 reference from that layer's own value
    and output projections, so the sinks view's value-weighted shares and the value-weighted rollout exist."""
    from PIL import Image

    from attnscope.runs.head import run_head
    from attnscope.runs.head_result import HeadOptions

    folder, tower = towers(kind)
    path = draw(tmp_path / "cat.png")
    result = run_head(HeadOptions(model=str(folder), layer=0, head=1, image=str(path), all_layers=True))
    pixels = _reference_pixels(folder, Image.open(path))
    assert result.layer_norms is not None and len(result.layer_norms) == 2
    for layer, mine in enumerate(result.layer_norms):
        pattern, values, W_O = _eager(tower, pixels, layer)
        norms, _ = _moved_reference(pattern, values, W_O)
        torch.testing.assert_close(mine, norms, atol=1e-5, rtol=1e-5)
    assert result.rollout_weighted is not None
    assert result.layer_heads is not None and all(h.moved() is not None for h in result.layer_heads)
