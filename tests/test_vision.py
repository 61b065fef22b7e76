"""`head --image` on vision towers: every layer's every head held equal to transformers' eager `output_attentions`
on the same image through the folder's own image processor (here DINOv2 without registers, CLIP's vision model
alone and a whole SigLIP; ViT, DeiT, DINOv2 with registers, a whole CLIP and SigLIP's vision model alone are the
conformance matrix's rows, tests/test_conformance.py), the patch embedding to PyTorch's conv2d, the tokens'
labels to the grid, and the views (--all-layers, --json, --svg, --html, --check) on the same run.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from cli_main import run_main
from tiny_vision import PATCH, PREFIX, SIZE, build, draw, eager_attentions

from attnscope.runs.head import run_head
from attnscope.runs.head_result import HeadOptions

GRID = SIZE // PATCH


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    """Each kind's folder and transformers' eager tower loaded from it, and the test image."""
    root = tmp_path_factory.mktemp("vision")
    image = draw(root / "picture.png")
    kinds = ("vit", "dinov2", "dinov2_with_registers", "clip_vision_model", "siglip", "siglip_vision_model")
    return {kind: (root / kind, build(kind, root / kind)) for kind in kinds}, image


@pytest.mark.parametrize("kind", ["dinov2", "clip_vision_model", "siglip"])  # the others: test_conformance
def test_every_layer_every_head_equals_eager(towers, kind):
    folders, image = towers
    folder, eager = folders[kind]
    theirs = eager_attentions(eager, folder, image)  # [n_batch, n_head, n_tokens, n_tokens] per layer
    for layer in range(len(theirs)):
        result = run_head(HeadOptions(model=str(folder), layer=layer, head=1, image=str(image)))
        assert result.tracer == "attention-interface" and result.traced
        # self-checked (no layer_idx: the module is known by its call's order), nothing differs, none "not run"
        assert not [n for n in result.notes if "differ" in n or "self-check" in n], result.notes
        torch.testing.assert_close(result.all_heads, theirs[layer][0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(result.run.head["attention"], theirs[layer][0, 1], atol=1e-6, rtol=1e-5)
    every = run_head(HeadOptions(model=str(folder), layer=1, head=0, image=str(image), all_layers=True))
    assert len(every.layer_patterns) == len(theirs)
    for mine, reference in zip(every.layer_patterns, theirs, strict=True):
        torch.testing.assert_close(mine, reference[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["vit", "dinov2_with_registers", "siglip"])
def test_tokens_patches_and_steps(towers, kind):
    """The labels follow the embeddings' order; `patches` is PyTorch's conv2d of the processor's pixel_values
    with the checkpoint's kernel, flattened row by row; the steps name n_patches."""
    from safetensors.torch import load_file

    folders, image = towers
    folder, eager = folders[kind]
    result = run_head(HeadOptions(model=str(folder), layer=0, head=0, image=str(image)))
    labels = PREFIX[kind] + [f"p({r},{c})" for r in range(GRID) for c in range(GRID)]
    assert result.encoded.tokens == labels
    layer = result.run.layer
    assert layer.step("patches").dims == ("n_batch", "n_patches", "d_model")
    assert "n_patches = (32/8) * (32/8) = 16" in layer.step("patches").op
    weights = load_file(folder / "model.safetensors")
    kernel = next(v for k, v in weights.items() if k.endswith(("patch_embeddings.projection.weight",
                                                                  "patch_embedding.weight")) and "vision" in k
                  or k.endswith("patch_embeddings.projection.weight"))
    bias = weights[next(k for k in weights if k.endswith(("projection.bias", "patch_embedding.bias")))]
    expected = F.conv2d(layer["pixel_values"].double(), kernel.double(), bias.double(), stride=PATCH)
    torch.testing.assert_close(layer["patches"].double(), expected.flatten(2).transpose(1, 2), atol=1e-5, rtol=1e-5)
    assert result.picture.grid.n_patches == GRID * GRID and result.picture.image.size == (SIZE, SIZE)


def test_cli_views(towers, tmp_path):
    """The terminal shows the overlay; --json names the grid and is the same pattern; --svg embeds the image
    under the weights; --html carries the image to the page; --check passes."""
    folders, image = towers
    folder = str(folders["dinov2_with_registers"][0])
    shown = run_main("head", "--model", folder, "--image", str(image), "--layer", "1", "--head", "2")
    assert shown.code == 0, shown.stderr
    assert "query [CLS]'s weights over the image" in shown.stdout
    assert "apart from the image: [CLS]" in shown.stdout and "reg1" in shown.stdout
    assert max(len(line) for line in shown.stdout.splitlines()) <= 80
    out = run_main("head", "--model", folder, "--image", str(image), "--layer", "1", "--head", "2", "--json",
                   "--all-layers", "--check")
    assert out.code == 0, out.stderr
    data = out.json()
    assert data["params"]["image"] == str(image) and data["params"]["query"] is None
    grid = data["image"]
    assert (grid["rows"], grid["cols"], grid["n_patches"], grid["first_patch"]) == (GRID, GRID, GRID * GRID, 3)
    assert grid["prefix"] == ["[CLS]", "reg0", "reg1"]
    cls_row = torch.tensor(data["attention"])[0]
    torch.testing.assert_close(torch.tensor(grid["overlays"][0]["patches"]).flatten(), cls_row[3:], atol=1e-6,
                               rtol=0)
    assert all(c["max_abs_diff"] <= c["tolerance"] for c in data["check"]), data["check"]
    rollout = grid["overlays"][1]  # --all-layers: the rollout's [CLS] row over the image too
    assert "rollout" in rollout["title"] and list(rollout["prefix"]) == ["[CLS]", "reg0", "reg1"]
    torch.testing.assert_close(torch.tensor(rollout["patches"]).flatten(), torch.tensor(data["rollout"][0][3:]),
                               atol=1e-6, rtol=0)
    svg = tmp_path / "over.svg"
    page = tmp_path / "page.html"
    done = run_main("head", "--model", folder, "--image", str(image), "--layer", "1", "--svg", str(svg),
                    "--html", str(page))
    assert done.code == 0, done.stderr
    text = svg.read_text()
    assert text.startswith("<svg") and "data:image/png;base64," in text and text.count('class="p"') == GRID * GRID
    assert "<title>p(3,3): " in text
    assert "data:image/png;base64," in page.read_text()


def test_siglip_shows_the_mean_row(towers):
    folders, image = towers
    result = run_head(HeadOptions(model=str(folders["siglip_vision_model"][0]), layer=0, head=3, image=str(image)))
    from attnscope.render.overlay import head_overlays

    (overlay,) = head_overlays(result)
    assert "mean" in overlay.title and overlay.prefix == []
    mean = result.attention.double().mean(0).reshape(GRID, GRID)
    torch.testing.assert_close(torch.tensor(overlay.cells, dtype=torch.float64), mean)


def test_json_is_strict(towers):
    folders, image = towers
    out = run_main("head", "--model", str(folders["vit"][0]), "--image", str(image), "--json")
    assert out.code == 0
    json.loads(out.stdout, parse_constant=lambda name: pytest.fail(f"JSON holds {name}"))


@pytest.mark.parametrize("side", [3, 14, 37, 90])
def test_terminal_grid_fits_80_columns(side):
    """A grid of any size fits the width: two characters a patch, one, or columns pooled (their mean), and the
    cells follow the row (the largest patch drawn full)."""
    from types import SimpleNamespace

    from PIL import Image
    from rich.console import Console

    from attnscope.models.vision.patches import Grid, Picture
    from attnscope.render.overlay import show_overlay

    grid = Grid.of(side * 4, side * 4, 4, ["[CLS]"])
    row = torch.rand(grid.n_tokens, dtype=torch.float64)
    row[grid.token(side - 1, side - 1)] = 10.0  # its block outweighs any other, pooled or not
    attention = (row / row.sum()).expand(grid.n_tokens, -1)
    result = SimpleNamespace(picture=Picture(Image.new("RGB", (side * 4, side * 4)), grid, "x.png", "P"),
                             attention=attention, layer_name="layer 0", options=SimpleNamespace(head=0),
                             rollout=None, layers=None)
    out = Console(width=80, record=True, no_color=True, file=open("/dev/null", "w"))  # noqa: SIM115
    show_overlay(out, result)
    lines = out.export_text().splitlines()
    assert max(map(len, lines)) <= 80
    assert f"{side} x {side} patches" in "\n".join(lines) and lines[-1].startswith("apart from the image: [CLS]")
    last = lines[-2]  # the grid's last row: its last cell is the largest patch, drawn full
    assert last.rstrip().endswith("█"), last


@pytest.mark.parametrize("name", ["ViTForImageClassification", "DeiTForImageClassificationWithTeacher"])
def test_task_checkpoints_read_their_tower(tmp_path, name):
    """The published ViT and DeiT are saved with their classifiers (`vit.`, `deit.` keys): the tower is read from
    them, equal to eager's tower loaded from the same folder."""
    import transformers
    from tiny_models import perturb
    from tiny_vision import SIZES

    config = (transformers.ViTConfig if name.startswith("ViT") else transformers.DeiTConfig)(**SIZES, num_labels=3)
    perturb(getattr(transformers, name)(config)).save_pretrained(tmp_path)
    transformers.ViTImageProcessorPil(size={"height": SIZE, "width": SIZE}).save_pretrained(tmp_path)
    image = draw(tmp_path / "picture.png")
    tower = (transformers.ViTModel if name.startswith("ViT") else transformers.DeiTModel).from_pretrained(
        tmp_path, attn_implementation="eager", add_pooling_layer=False)
    theirs = eager_attentions(tower.eval(), tmp_path, image)
    result = run_head(HeadOptions(model=str(tmp_path), layer=1, head=2, image=str(image)))
    assert result.info.architecture == name and result.encoded.tokens[0] == "[CLS]"
    torch.testing.assert_close(result.all_heads, theirs[1][0], atol=1e-6, rtol=1e-5)


def test_dinov2_any_size_drops_the_partial_patch(towers, tmp_path):
    """DINOv2 reads any size: a processor that keeps the aspect (no crop) makes 36 x 54 pixels, a 4 x 6 grid
    (the convolution drops the partial patch at the edge), equal to eager; the SVG clips the image to the grid."""
    import shutil

    import transformers

    folders, _ = towers
    folder, eager = folders["dinov2"]
    mine = tmp_path / "dinov2"
    shutil.copytree(folder, mine)
    transformers.BitImageProcessorPil(size={"shortest_edge": 36}, do_center_crop=False).save_pretrained(mine)
    image = draw(tmp_path / "wide.png", 60, 40)
    result = run_head(HeadOptions(model=str(mine), layer=1, head=0, image=str(image)))
    grid = result.picture.grid
    assert (grid.rows, grid.cols) == (4, 6) and result.encoded.tokens[-1] == "p(3,5)"
    assert "n_patches = floor(36/8) * floor(54/8) = 4 * 6 = 24" in " ".join(result.run.layer.notes)
    torch.testing.assert_close(result.all_heads, eager_attentions(eager, mine, image)[1][0], atol=1e-6, rtol=1e-5)
    from attnscope.render.overlay import overlay_svg

    svg = overlay_svg(result)
    assert 'clip-path="url(#grid-0)"' in svg and svg.count('class="p"') == 24


def test_query_picks_the_row_over_the_image(towers, tmp_path):
    """--query names the row drawn over the image (a label or an index): the terminal, --json and the page's
    first overlay; a name of no token is refused in one line."""
    folders, image = towers
    folder = str(folders["dinov2_with_registers"][0])
    args = ["head", "--model", folder, "--image", str(image), "--layer", "1", "--head", "1"]
    data = run_main(*args, "--query", "p(2, 1)", "--json").json()
    row = torch.tensor(data["attention"])[3 + 2 * GRID + 1]  # [CLS], reg0, reg1, then row 2's second patch
    overlay = data["image"]["overlays"][0]
    assert "query 12 “p(2,1)”" in overlay["title"]
    torch.testing.assert_close(torch.tensor(overlay["patches"]).flatten(), row[3:], atol=1e-6, rtol=0)
    assert overlay["prefix"]["reg1"] == pytest.approx(float(row[2]), abs=1e-6)
    shown = run_main(*args, "--query", "2")
    assert shown.code == 0 and "query 2 “reg1”'s weights over the image" in shown.stdout
    page = tmp_path / "page.html"
    assert run_main(*args, "--query", "p(2,1)", "--html", str(page)).code == 0
    assert '"query":12' in page.read_text()
    from cli_main import assert_usage_error

    assert_usage_error(run_main(*args, "--query", "p(9,9)"), "--query 'p(9,9)' names no token", "[CLS], reg0")
    assert_usage_error(run_main(*args, "--query", "99"), "an index from 0 to 18")
