"""Head statistics on an image's patch grid (attnscope/readings/gridstats.py): each figure against a float64
formula written out here over transformers' eager `output_attentions` of tiny ViT, DeiT ([DIST]), DINOv2 with
registers (a 4 x 6 grid: rows and columns told apart) and SigLIP (no [CLS]), the grid against the processor's
patch layout (row-major, r = i // n_cols), a VLM's text's share on its image against eager's, the kinds on a grid,
the terminal's table, --json (heads and all_layers, null and never NaN), the page's table in Chromium, and the
Q step's words for a model without RoPE.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from cli_main import run_main
from tiny_models import perturb
from tiny_vision import _model, _processor, draw

from attnscope.readings.gridstats import FIGURES, layout
from attnscope.readings.headstats import LayerHeads
from attnscope.runs.head import run_head
from attnscope.runs.head_result import HeadOptions

KINDS = ("vit", "deit", "dinov2_with_registers", "siglip_vision_model")
SHARPEN = 4.0  # the queries' weights scaled up: patterns far from uniform, so that a wrong figure shows


def _build(kind: str, folder):
    """A tiny tower whose heads look somewhere (its query weights scaled), saved with its processor; DINOv2's
    processor keeps the aspect (no crop), so the wide test image makes a 4 x 6 grid."""
    import transformers

    torch.manual_seed(7 + KINDS.index(kind))
    model = perturb(_model(kind))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("query.weight", "q_proj.weight")):
                weight.mul_(SHARPEN)
    model.save_pretrained(folder)
    if kind.startswith("dinov2"):
        transformers.BitImageProcessorPil(size={"shortest_edge": 32}, do_center_crop=False).save_pretrained(folder)
    else:
        _processor(kind).save_pretrained(folder)
    tower = type(model).from_pretrained(folder, attn_implementation="eager")
    return tower.eval()


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    root = tmp_path_factory.mktemp("grid")
    picture = draw(root / "wide.png", 72, 48)
    return {kind: (root / kind, _build(kind, root / kind)) for kind in KINDS}, picture


def _eager(tower, folder, picture):
    """The processor's pixel_values and eager's every layer's `[n_head, n_tokens, n_tokens]` in float64."""
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
    pixels = processor(images=Image.open(picture).convert("RGB"), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        attentions = tower(pixel_values=pixels, output_attentions=True).attentions
    return pixels, [a[0].double() for a in attentions]


def _geometry(tower, pixels):
    """From the model's config and the processor's output alone: the tokens before the patches (cls, dist,
    registers) and each patch token's (row, column), row-major as the Conv2d flattens: r = i // n_cols."""
    config = tower.config
    patch = config.patch_size
    n_rows, n_cols = pixels.shape[-2] // patch, pixels.shape[-1] // patch
    n_cls = 0 if config.model_type.startswith("siglip") else 1
    n_dist = 1 if config.model_type == "deit" else 0
    n_reg = getattr(config, "num_register_tokens", 0)
    prefix = n_cls + n_dist + n_reg
    cells = {prefix + i: (i // n_cols, i % n_cols) for i in range(n_rows * n_cols)}
    return (n_rows, n_cols), list(range(n_cls)), list(range(n_cls, n_cls + n_dist)), \
        list(range(n_cls + n_dist, prefix)), cells


def _reference(A, cells, cls, dist, registers):
    """The figures of one head's `[n, n]` pattern, written out with loops in float64 (gridstats.py's docstring)."""
    sums = dict.fromkeys(("self", "row", "column", "neighbours", "patches", "cls", "distillation", "registers"), 0.0)
    moved = landed = 0.0
    for i, (ri, ci) in cells.items():
        for j, (rj, cj) in cells.items():
            w = float(A[i, j])
            sums["self"] += w * (i == j)
            sums["row"] += w * (ri == rj and i != j)
            sums["column"] += w * (ci == cj and i != j)
            sums["neighbours"] += w * (max(abs(ri - rj), abs(ci - cj)) == 1)
            sums["patches"] += w
            moved += w * math.hypot(ri - rj, ci - cj)
            landed += w
        for name, tokens in (("cls", cls), ("distillation", dist), ("registers", registers)):
            sums[name] += sum(float(A[i, j]) for j in tokens)
    figures = {name: total / len(cells) for name, total in sums.items()}
    for name, tokens in (("cls", cls), ("distillation", dist), ("registers", registers)):
        if not tokens:
            figures[name] = None
    return figures | {"distance": moved / landed, "text_to_image": None}


def _close(mine: dict, theirs: dict, what: str) -> None:
    assert set(mine) == set(FIGURES) == set(theirs), what
    for name in FIGURES:
        if theirs[name] is None:
            assert mine[name] is None, f"{what}: {name}"
        else:
            assert mine[name] == pytest.approx(theirs[name], abs=1e-5), f"{what}: {name}"


def _opened(towers, kind: str):
    """A tower's folder, the test image, eager's patterns and the geometry from its config and processor."""
    folders, picture = towers
    folder, tower = folders[kind]
    pixels, theirs = _eager(tower, folder, picture)
    return folder, picture, theirs, _geometry(tower, pixels)


@pytest.mark.parametrize("kind", KINDS)
def test_every_figure_equals_the_formula_over_eager(towers, kind):
    folder, picture, theirs, (grid, cls, dist, registers, cells) = _opened(towers, kind)
    for layer, pattern in enumerate(theirs):
        result = run_head(HeadOptions(model=str(folder), layer=layer, head=0, image=str(picture), all_heads=True))
        heads = result.heads
        assert heads.grid is not None and heads.grid.tower and heads.grid.grids == (grid,)
        for head in heads.heads:
            expected = _reference(pattern[head["head"]], cells, cls, dist, registers)
            _close(head["grid_stats"], expected, f"{kind} layer {layer} head {head['head']}")
            assert {"entropy", "first", "previous", "self", "distance", "spread"} <= set(head["stats"])  # kept
    if kind == "dinov2_with_registers":
        assert grid == (4, 6)  # not square: a row/column mix-up would show


@pytest.mark.parametrize("kind", KINDS)
def test_the_grid_is_the_processors_patch_layout(towers, kind):
    folder, picture, _, (grid, cls, dist, registers, cells) = _opened(towers, kind)
    result = run_head(HeadOptions(model=str(folder), layer=0, head=0, image=str(picture)))
    found = layout(result.encoded.tokens)
    assert found is not None and found.tower and found.grids == (grid,)
    assert (list(found.cls), list(found.distillation), list(found.registers)) == (cls, dist, registers)
    assert {t: (found.row[t], found.col[t]) for t in range(len(found.image)) if found.image[t] >= 0} == cells


def test_vlm_text_share_on_its_image(tmp_path):
    """A LLaVA's prompt: the text after the image keeps its 1-D figures and gains its share on the image's
    tokens; the image's 2 x 2 tokens get the grid's figures; both against eager's output_attentions."""
    from tiny_vlm import TEXT, build, eager_attentions, image

    folder, picture = tmp_path / "llava", image(tmp_path / "picture.png")
    model = build("llava", folder)
    ids, theirs = eager_attentions(model, folder, TEXT, picture)
    result = run_head(HeadOptions(model=str(folder), layer=1, head=0, text=TEXT, image=str(picture),
                                  all_heads=True))
    heads = result.heads
    assert heads.grid is not None and not heads.grid.tower and heads.grid.grids == ((2, 2),)
    placed = [t for t, token in enumerate(ids) if token == model.config.image_token_id]  # the image's tokens
    cells = {t: divmod(k, 2) for k, t in enumerate(placed)}
    pattern = theirs[1][0].double()
    text = [q for q in range(len(ids)) if q not in cells and q > placed[0]]
    for head in heads.heads:
        A = pattern[head["head"]]
        share = sum(float(A[q, placed].sum()) for q in text) / len(text)
        expected = _reference(A, cells, [], [], []) | {"text_to_image": share}
        _close(head["grid_stats"], expected, f"llava head {head['head']}")
        assert {"previous", "distance"} <= set(head["stats"])  # the text's 1-D figures stay
    shown = run_main("head", "--model", str(folder), "--layer", "1", "--text", TEXT, "--image", str(picture),
                     "--all-heads")
    assert shown.code == 0, shown.stderr
    header = next(line.split() for line in shown.stdout.splitlines() if line.split()[:2] == ["head", "kind"])
    assert "previous" in header and header[-1] == "image"  # piped, the header ends at its last column
    assert "8 nbrs" not in shown.stdout


def _labels(n_rows: int, n_cols: int, prefix: list[str]) -> list[str]:
    return prefix + [f"p({r},{c})" for r in range(n_rows) for c in range(n_cols)]


def test_kinds_on_a_grid():
    """Each patch looking at its left neighbour is `previous-token` by the sequence's order but `local` on the
    grid; a head whose weight all sits on [CLS] has no distance (None) and is `first-token`."""
    labels = _labels(3, 4, ["[CLS]"])
    n = len(labels)
    left = torch.zeros(n, n, dtype=torch.float64)
    left[0, 0] = 1.0
    for t in range(1, n):
        r, c = divmod(t - 1, 4)
        left[t, t - 1 if c else t] = 1.0
    on_cls = torch.zeros(n, n, dtype=torch.float64)
    on_cls[:, 0] = 1.0
    heads = LayerHeads.of(torch.stack([left, on_cls]), "planted", labels, labels)
    (first, second) = heads.heads
    assert first["stats"]["previous"] > 0.5 and first["kind"] == "local"
    assert first["grid_stats"]["distance"] == pytest.approx(9 / 12)  # 9 of 12 patches one step left, 3 on itself
    assert first["grid_stats"]["row"] == pytest.approx(9 / 12) and first["grid_stats"]["column"] == 0.0
    assert second["kind"] == "first-token" and second["grid_stats"]["distance"] is None
    assert second["grid_stats"]["cls"] == 1.0 and second["grid_stats"]["registers"] is None
    text = LayerHeads.of(torch.stack([left]), "text", [f"t{i}" for i in range(n)], [f"t{i}" for i in range(n)])
    assert text.grid is None and text.heads[0]["kind"] == "previous-token" and "grid_stats" not in text.heads[0]
    from attnscope.views.notebook import heads_table_html  # a notebook's table: the grid's columns, "-" for None

    shown = heads_table_html(heads)
    assert ">[CLS]<" in shown and ">8 nbrs<" in shown and ">previous<" not in shown and ">registers<" not in shown
    assert ">0.75<" in shown and ">-<" in shown
    assert ">previous<" in heads_table_html(text)


@pytest.mark.parametrize("labels", [
    ["the", "p(0,0)", "p(0,1)"],  # patches among a text's tokens
    _labels(2, 2, ["[CLS]"])[:-1],  # a grid missing its last patch
    ["[CLS]", "p(0,0)", "p(1,0)", "p(0,1)", "p(1,1)"],  # column-major: not the Conv2d's order
    ["p(0,0)", "p(0,1)", "[CLS]", "p(1,0)", "p(1,1)"],  # not contiguous
    _labels(1, 2, []) + ["reg0"],  # a special token after the patches
    ["q0", "q1"],
])
def test_labels_that_are_no_grid(labels):
    assert layout(labels) is None


def test_two_images_in_a_prompt():
    """Two images' tokens among a text's: each its own grid; a patch's figures count its own image's patches only,
    and the text after the first image gives its weight on both; a causal pattern, against the loops."""
    labels = ["<s>", "img(0,0)", "img(0,1)", "img(1,0)", "img(1,1)", "img(2,0)", "img(2,1)", "a",
              "img2(0,0)", "img2(0,1)", "img2(0,2)", "img2(1,0)", "img2(1,1)", "img2(1,2)", "b", "c"]
    found = layout(labels)
    assert found is not None and not found.tower and found.grids == ((3, 2), (2, 3))
    assert found.image[:8] == (-1, 0, 0, 0, 0, 0, 0, -1) and (found.row[13], found.col[13]) == (1, 2)
    n = len(labels)
    torch.manual_seed(0)
    A = torch.softmax(torch.randn(3, n, n, dtype=torch.float64) * 3, dim=-1).tril()
    A = A / A.sum(dim=-1, keepdim=True)  # [3, n, n], causal rows summing to 1
    heads = LayerHeads.of(A, "prompt", labels, labels)
    first = {t: divmod(t - 1, 2) for t in range(1, 7)}
    second = {t: divmod(t - 8, 3) for t in range(8, 14)}
    text = [7, 14, 15]
    for h, head in enumerate(heads.heads):
        parts = [_reference(A[h], cells, [], [], []) for cells in (first, second)]
        moved = sum(p["distance"] * p["patches"] * 6 for p in parts)  # each part: a mean over its 6 queries
        expected = {name: (parts[0][name] + parts[1][name]) / 2 for name in ("self", "row", "column", "neighbours",
                                                                             "patches")}
        expected |= {"distance": moved / (6 * (parts[0]["patches"] + parts[1]["patches"])), "cls": None,
                     "distillation": None, "registers": None,
                     "text_to_image": sum(float(A[h, q, 1:7].sum() + A[h, q, 8:14].sum()) for q in text) / 3}
        _close(head["grid_stats"], expected, f"head {h}")


def test_terminal_json_and_page(towers, tmp_path):
    """The terminal's table has the grid's columns and no previous token, fits 80 columns; --json's heads and
    all_layers carry grid_stats equal to the run's, null and never NaN; the page's table shows them."""
    folders, picture = towers
    folder = str(folders["dinov2_with_registers"][0])
    args = ["head", "--model", folder, "--image", str(picture), "--layer", "1", "--all-heads"]
    shown = run_main(*args)
    assert shown.code == 0, shown.stderr
    header = next(line for line in shown.stdout.splitlines() if line.strip().startswith("head  kind"))
    assert header.split() == ["head", "kind", "entropy", "[CLS]", "registers", "self", "row", "column", "8", "nbrs",
                              "distance"]
    assert max(len(line) for line in shown.stdout.splitlines()) <= 80
    assert "sum over 1 keys" not in shown.stdout
    out = run_main(*args, "--all-layers", "--json")
    data = json.loads(out.stdout, parse_constant=lambda name: pytest.fail(f"{name} in --json"))
    every = run_main(*args, "--all-layers").stdout  # a tower's words: image tokens, no text kinds, [CLS]'s rollout
    assert "[2 layers x 4 heads, 27 image tokens]" in every and "previous-token" not in every
    rollout = torch.tensor(data["rollout"][0], dtype=torch.float64)  # [CLS]'s row
    top = int(rollout.argmax())
    assert f"rollout, [CLS] draws from: {top} {data['tokens'][top]} {float(rollout[top]):.2f}" in every
    result = run_head(HeadOptions(model=folder, layer=1, head=0, image=str(picture), all_heads=True))
    for mine, head in zip(data["heads"], result.heads.heads, strict=True):
        assert mine["grid_stats"] == pytest.approx(head["grid_stats"]) and mine["grid_stats"]["distillation"] is None
        assert set(mine["stats"]) >= {"entropy", "first", "previous", "self", "distance", "spread"}
    for mine, head in zip(data["all_layers"][1]["grid_stats"], result.heads.heads, strict=True):
        assert mine == pytest.approx(head["grid_stats"])
    siglip = run_main("head", "--model", str(folders["siglip_vision_model"][0]), "--image", str(picture),
                      "--all-heads", "--json").json()
    assert all(h["grid_stats"]["cls"] is None and h["grid_stats"]["registers"] is None for h in siglip["heads"])

    from browser import browser, chromium, open_page

    executable = chromium()
    if executable is None:  # the page is tested in a real browser where there is one (tests/browser.py)
        return
    page_file = tmp_path / "page.html"
    assert run_main(*args, "--html", str(page_file)).code == 0
    with browser(executable) as context:
        page = open_page(context, page_file).page
        table = page.get_by_test_id("head-stats")
        assert "over patch queries" in page.locator("#stats-about").inner_text()
        headers = table.locator("thead th").all_inner_texts()
        assert headers == ["head", "kind", "entropy (bits)", "[CLS]", "registers", "self", "row", "column",
                           "8 nbrs", "distance (patches)", "spread"]
        cells = table.locator("tbody tr").nth(2).locator("td").all_inner_texts()
        figures = data["heads"][2]["grid_stats"]
        assert cells[3:10] == [f"{figures[k]:.2f}" for k in ("cls", "registers", "self", "row", "column",
                                                             "neighbours")] + [f"{figures['distance']:.1f}"]


def test_the_q_step_says_no_rope_for_a_tower(towers, tmp_path):
    """The Q step of a tower names no RoPE it does not have; a rotary family through the interface still does."""
    folders, picture = towers
    for kind in ("vit", "siglip_vision_model"):
        result = run_head(HeadOptions(model=str(folders[kind][0]), layer=0, head=0, image=str(picture)))
        op = result.run.layer.step("Q").op
        assert "RoPE before" not in op and "no RoPE: positions are absolute embeddings added to the patch" in op
    from tiny_interface import build
    from tiny_models import SENTENCE

    build("gpt_neox", tmp_path / "neox")
    rotary = run_head(HeadOptions(model=str(tmp_path / "neox"), layer=0, head=0, text=SENTENCE))
    assert "(its projections, norms and RoPE before: not traced)" in rotary.run.layer.step("Q").op


def test_the_q_step_names_where_the_positions_went():
    """The four wordings, on modules standing in for a rotary family's NoPE layer (Llama 4's `use_rope`), a T5-like
    module handed a position_bias, a tower, and a family attnscope has no word for."""
    from types import SimpleNamespace

    from attnscope.models.nopage.positions import before as _before

    class Attention:
        def __init__(self, config, **more):
            self.config = SimpleNamespace(**config)
            self.__dict__.update(more)

    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "model_type": "llama4_text"}
    assert _before(Attention(rope), {}) == "(its projections, norms and RoPE before: not traced)"
    assert _before(Attention(rope, use_rope=False), {}).endswith("; no RoPE in this layer")
    assert _before(Attention({"model_type": "t5"}), {"position_bias": torch.zeros(1)}).endswith(
        "no RoPE: positions enter as position_bias, below")
    assert _before(Attention({"model_type": "deit"}), {}).endswith("added to the patch embeddings before the first "
                                                                   "layer")
    assert _before(Attention({"model_type": "segformer"}), {}) == "(its projections and norms before: not traced); " \
                                                                   "no RoPE"
