"""Bad images and bad vision folders get one line and exit 2, checked before any large image is decoded (Pillow's
decompression-bomb limit kept on); odd but valid images (grey, palette, alpha, JPEG) are read as the model's own
image processor reads them. Each image is made here, byte by byte where it is broken.
"""

from __future__ import annotations

import io
import json
import struct
import time
import zlib

import pytest
import torch
from cli_main import assert_usage_error, run_main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_vision import build, draw, eager_attentions

from attnscope.errors import UsageError
from attnscope.models.vision.image import FORMATS, read_header, read_image


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares `width` x `height` RGB pixels and holds none: only a decoder would find out."""
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + _chunk(b"IEND", b""))


def encoded(fmt: str, mode: str = "RGB", size: tuple[int, int] = (40, 30)) -> bytes:
    from PIL import Image

    image = Image.new(mode, size, color=(200, 30, 90) if mode in ("RGB", "RGBA") else 100)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision-bad") / "vit"
    return folder, build("vit", folder)


BAD = {  # file name -> (its bytes, words the one line says)
    "text.png": (b"this is not an image at all", ("is not an image Pillow can read", "b'this is ")),
    "empty.jpg": (b"", ("the file is empty",)),
    "cut.png": (encoded("PNG")[:60], ("truncated",)),
    "signature.png": (b"\x89PNG\r\n\x1a\n", ("starts as a PNG", "truncated or damaged")),
    "cut.jpg": (encoded("JPEG")[:200], ("truncated",)),
    "huge.png": (png_header(100_000, 100_000), ("decompression-bomb limit",)),
    "bomb.png": (png_header(10_000, 10_000), ("decompression-bomb limit",)),
    "icon.ico": (encoded("ICO", size=(16, 16)), ("is an image in ICO format", "convert it to PNG")),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_image_one_line_exit_2(vit, tmp_path, name):
    data, words = BAD[name]
    path = tmp_path / name
    path.write_bytes(data)
    start = time.perf_counter()
    outcome = run_main("head", "--model", str(vit[0]), "--image", str(path))
    assert_usage_error(outcome, "--image", str(path), *words)
    assert time.perf_counter() - start < 10  # a declared 10^10 pixels is refused from the header, never allocated


@pytest.mark.parametrize("where", ["missing.png", ""])
def test_missing_or_folder(vit, tmp_path, where):
    outcome = run_main("head", "--model", str(vit[0]), "--image", str(tmp_path / where))
    assert_usage_error(outcome, "--image", "no such file" if where else "a folder, not an image file")


def test_folder_problems(vit, tmp_path):
    folder, _ = vit
    picture = draw(tmp_path / "cat.png")
    assert_usage_error(run_main("head", "--model", str(folder)), "vision tower", "give --image FILE")
    assert_usage_error(run_main("head", "--model", str(folder), "--image", str(picture), "--text", "a cat"),
                       "vision tower", "drop --text")
    assert_usage_error(run_main("head", "--model", str(folder), "--image", str(picture), "--layer", "2"),
                       "--layer 2 is out of range", "2 layers")
    assert_usage_error(run_main("head", "--model", str(folder), "--image", str(picture), "--head", "4"), "--head 4")
    assert_usage_error(run_main("head", "--model", str(folder), "--image", str(picture), "--generate", "2"),
                       "drop --generate")
    tight = run_main("head", "--model", str(folder), "--image", str(picture), "--max-memory", "10KB")
    assert tight.code == 1 and len(tight.error_lines) == 1, tight.stderr  # the guard: a run-time failure, exit 1
    assert "image tokens needs about" in tight.stderr and "pick an earlier --layer" in tight.stderr
    assert "--text" not in tight.stderr
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(folder / name)
    assert_usage_error(run_main("head", "--model", str(bare), "--image", str(picture)),
                       "has no preprocessor_config.json", "save_pretrained")
    settings_ = json.loads((folder / "preprocessor_config.json").read_text())
    (bare / "preprocessor_config.json").write_text(json.dumps({**settings_, "size": {"height": 48, "width": 48}}))
    assert_usage_error(run_main("head", "--model", str(bare), "--image", str(picture)),
                       "makes 48 x 48 pixels", "reads 32 x 32", "different models")
    (bare / "preprocessor_config.json").write_text(json.dumps({**settings_, "auto_map": {
        "AutoImageProcessor": "mine.MyProcessor"}}))
    assert_usage_error(run_main("head", "--model", str(bare), "--image", str(picture)), "never runs code")


@pytest.mark.parametrize(("fmt", "mode"), [("PNG", "L"), ("PNG", "P"), ("PNG", "RGBA"), ("JPEG", "RGB"),
                                           ("GIF", "P"), ("WEBP", "RGB")])
def test_odd_but_valid_images_as_transformers_reads_them(vit, tmp_path, fmt, mode):
    """Grey, palette, alpha, JPEG: read, made RGB as the processors' convert_rgb does, equal to eager's run on
    the same RGB picture."""
    from attnscope.runs.head import run_head
    from attnscope.runs.head_result import HeadOptions

    folder, eager = vit
    path = tmp_path / f"picture.{fmt.lower()}"
    path.write_bytes(encoded(fmt, mode))
    assert read_header(path).format in FORMATS
    result = run_head(HeadOptions(model=str(folder), layer=1, head=0, image=str(path)))
    rgb = tmp_path / "as-rgb.png"
    read_image(path).save(rgb)
    torch.testing.assert_close(result.all_heads, eager_attentions(eager, folder, rgb)[1][0], atol=1e-6, rtol=1e-5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=0, max_value=400), junk=st.binary(max_size=64), fmt=st.sampled_from(["PNG", "JPEG"]))
def test_fuzzed_files_read_or_refused(tmp_path, cut, junk, fmt):
    """A valid file cut anywhere, with junk after: either read whole, or one UsageError naming {image}."""
    data = encoded(fmt)
    path = tmp_path / f"fuzzed.{fmt.lower()}"
    path.write_bytes(data[:cut] + junk)
    try:
        image = read_image(path)
    except UsageError as exc:
        assert exc.params == ("image",) and "\n" not in str(exc)
    else:
        assert image.mode == "RGB" and image.size == (40, 30)


def test_query_needs_a_vision_tower(tmp_path):
    from tiny_models import build as build_text

    build_text("gpt2", tmp_path / "gpt2")
    outcome = run_main("head", "--model", str(tmp_path / "gpt2"), "--text", "The cat sat.", "--query", "p(0,0)")
    assert_usage_error(outcome, "--query picks the row a vision tower's overlay draws", "model_type 'gpt2'",
                       "drop --query")


def test_rgb_on_a_transformers_without_return_numpy(monkeypatch):
    """transformers 5.17's `convert_to_rgb(image)` takes no `return_numpy` and hands back a PIL image (a long
    property run on a machine with that transformers found every RGB conversion raising TypeError): the picture,
    and Llama 4's tiles, are the same as through the newer signature."""
    import numpy as np
    from PIL import Image
    from transformers import image_transforms

    from attnscope.models.vision import llama4_tiles
    from attnscope.models.vision.processor import to_rgb

    pixels = torch.Generator().manual_seed(3)
    picture = Image.fromarray(torch.randint(0, 256, (7, 9, 4), generator=pixels, dtype=torch.uint8).numpy(), "RGBA")
    rgb, tiles = np.asarray(to_rgb(picture)), llama4_tiles._as_tensor(picture, True)
    newer = image_transforms.convert_to_rgb

    def older(image, input_data_format=None):  # the signature before return_numpy: a PIL image back
        return Image.fromarray(np.asarray(newer(image, return_numpy=True)), "RGB")

    monkeypatch.setattr(image_transforms, "convert_to_rgb", older)
    assert np.array_equal(np.asarray(to_rgb(picture)), rgb)
    assert torch.equal(llama4_tiles._as_tensor(picture, True), tiles)
    assert not np.array_equal(rgb, np.asarray(picture)[..., :3])  # the transparency was composited, not dropped
