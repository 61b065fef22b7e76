"""Tiny random vision towers (ViT, DeiT, DINOv2 with and without registers, CLIP and SigLIP whole and their
vision models alone) saved with their own image processors (the PIL backends), and a test image drawn here.

`build(kind, folder)` saves the model (every weight perturbed, tests/tiny_models.py) and its processor and returns
transformers' eager tower loaded back from the folder: the oracle (`output_attentions=True`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import perturb

SIZE, PATCH = 32, 8  # a 4 x 4 grid of patches
SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, image_size=SIZE,
             patch_size=PATCH)
KINDS = ("vit", "deit", "dinov2", "dinov2_with_registers", "clip", "clip_vision_model", "siglip",
         "siglip_vision_model")
# each kind's tokens before the patches
PREFIX = {"vit": ["[CLS]"], "deit": ["[CLS]", "[DIST]"], "dinov2": ["[CLS]"],
          "dinov2_with_registers": ["[CLS]", "reg0", "reg1"], "clip": ["[CLS]"], "clip_vision_model": ["[CLS]"],
          "siglip": [], "siglip_vision_model": []}


def _model(kind: str):
    import transformers as t

    if kind == "vit":
        return t.ViTModel(t.ViTConfig(**SIZES))
    if kind == "deit":
        return t.DeiTModel(t.DeiTConfig(**SIZES))
    if kind == "dinov2":
        return t.Dinov2Model(t.Dinov2Config(**SIZES, mlp_ratio=2))
    if kind == "dinov2_with_registers":
        return t.Dinov2WithRegistersModel(t.Dinov2WithRegistersConfig(**SIZES, mlp_ratio=2, num_register_tokens=2))
    text = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "clip":
        return t.CLIPModel(t.CLIPConfig(text_config=text, vision_config=SIZES, projection_dim=16))
    if kind == "clip_vision_model":
        return t.CLIPVisionModel(t.CLIPVisionConfig(**SIZES))
    if kind == "siglip":
        return t.SiglipModel(t.SiglipConfig(text_config=text, vision_config=SIZES))
    return t.SiglipVisionModel(t.SiglipVisionConfig(**SIZES))


def _processor(kind: str):
    import transformers as t

    square = {"height": SIZE, "width": SIZE}
    if kind.startswith("clip"):
        return t.CLIPImageProcessorPil(size={"shortest_edge": SIZE}, crop_size=square)
    if kind.startswith("siglip"):
        return t.SiglipImageProcessorPil(size=square)
    if kind.startswith("dinov2"):  # DINOv2's own is a BitImageProcessor: resize the short edge, crop the centre
        return t.BitImageProcessorPil(size={"shortest_edge": SIZE}, crop_size=square, do_center_crop=True)
    return t.ViTImageProcessorPil(size=square)  # ViT and DeiT


TOWER = {"vit": "ViTModel", "deit": "DeiTModel", "dinov2": "Dinov2Model",
         "dinov2_with_registers": "Dinov2WithRegistersModel", "clip": "CLIPVisionModel",
         "clip_vision_model": "CLIPVisionModel", "siglip": "SiglipVisionModel",
         "siglip_vision_model": "SiglipVisionModel"}


def build(kind: str, folder: Path):
    """Save `kind`'s tiny model and its image processor in `folder`; transformers' eager tower, loaded back."""
    import transformers

    torch.manual_seed(len(kind))
    model = perturb(_model(kind))
    model.save_pretrained(folder)
    _processor(kind).save_pretrained(folder)
    tower = getattr(transformers, TOWER[kind]).from_pretrained(folder, attn_implementation="eager")
    return tower.eval()


def draw(path: Path, width: int = 48, height: int = 40) -> Path:
    """A test image: a dark cat's silhouette (head, ears, body) on a pale grey gradient, neutral in colour so
    that the weights painted over it read, and different from patch to patch."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height))
    pixels = image.load()
    for x in range(width):
        for y in range(height):
            grey = 170 + (x + y) * 60 // (width + height)
            pixels[x, y] = (grey, grey, grey - 10)
    pen = ImageDraw.Draw(image)
    w, h = width / 48, height / 40  # drawn for 48 x 40, scaled to the size asked
    pen.ellipse((26 * w, 18 * h, 46 * w, 38 * h), fill=(60, 55, 50))  # the body
    pen.ellipse((8 * w, 8 * h, 26 * w, 26 * h), fill=(45, 40, 38))  # the head
    pen.polygon([(9 * w, 12 * h), (11 * w, 2 * h), (16 * w, 9 * h)], fill=(45, 40, 38))  # the ears
    pen.polygon([(18 * w, 9 * h), (23 * w, 2 * h), (25 * w, 12 * h)], fill=(45, 40, 38))
    pen.ellipse((12 * w, 14 * h, 14 * w, 16 * h), fill=(220, 200, 60))  # the eyes
    pen.ellipse((19 * w, 14 * h, 21 * w, 16 * h), fill=(220, 200, 60))
    image.save(path)
    return path


def eager_attentions(tower, folder: Path, image: Path) -> tuple:
    """transformers' eager run on the image through the folder's processor: every layer's `output_attentions`."""
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
    pixels = processor(images=Image.open(image).convert("RGB"), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        return tower(pixel_values=pixels, output_attentions=True).attentions


def conformance_cell(runner, app, folder: Path, eager, view: str) -> None:
    """A vision tower's cell of the conformance matrix (tests/test_conformance.py) on its folder's picture.png:
    short, every layer's every head (--all-heads) equal to eager's output_attentions; all-layers, every layer's
    pattern; check, PASS; long and generate refused in one line, exit 2."""
    import json

    image = folder / "picture.png"
    theirs = eager_attentions(eager, folder, image)  # [1, n_head, n_tokens, n_tokens] per layer
    base = ["head", "--model", str(folder), "--image", str(image)]

    def payload(*more: str) -> dict:
        result = runner.invoke(app, [*base, *more, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    def close(mine, reference, what: str) -> None:
        torch.testing.assert_close(torch.tensor(mine), reference.float(), atol=1e-5, rtol=0, msg=what)

    if view == "short":
        for layer, pattern in enumerate(theirs):
            got = payload("--layer", str(layer), "--all-heads")
            assert got["traced"] is True and got["tracer"] == "attention-interface"
            for head in got["heads"]:
                close(head["attention"], pattern[0, head["head"]], f"layer {layer} head {head['head']}")
    elif view == "all-layers":
        got = payload("--layer", "0", "--all-layers")
        assert len(got["all_layers"]) == len(theirs)
        for entry, pattern in zip(got["all_layers"], theirs, strict=True):
            close(entry["attention"], pattern[0], f"all-layers layer {entry['layer']}")
    elif view == "check":
        got = payload("--layer", str(len(theirs) - 1), "--check")
        assert got["check_passed"] is True and got["check"], got["check"]
    else:  # refused: no long view of an image, no decoding
        more = {"long": ["--rows", "0:4"], "generate": ["--generate", "2"]}[view]
        result = runner.invoke(app, [*base, *more])
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
        assert "vision tower" in result.stderr and "Traceback" not in result.stderr
