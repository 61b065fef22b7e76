"""The page as a new user met it (issue 43, items 7, 12, 16), in Chromium through Playwright: a query's strongest
keys never padded with masked keys and "show all" only where it adds keys; the kinds grid of a run without
layers says its rows are batch elements; a decode row picked by its label; "how to read this" names every kind;
a model's tokens shown as its tokenizer decodes them; the image overlay's colour scale. Each failed before."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from browser import browser, chromium, open_page
from tiny_models import SENTENCE, build

from attnscope.cli import app
from attnscope.readings.headstats import KINDS

CHROMIUM = chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found (apt-get install chromium, or set "
                                                          "ATTNSCOPE_CHROMIUM): the page is tested in a real browser")


@pytest.fixture(scope="module")
def context():
    assert CHROMIUM is not None
    with browser(CHROMIUM) as ctx:
        yield ctx


def run(runner, args: list[str], html: Path) -> dict:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    written = runner.invoke(app, [*args, "--html", str(html)])
    assert written.exit_code == 0 and html.is_file(), written.output
    return json.loads(result.stdout)


def finish(o) -> None:
    assert o.errors == []
    assert o.requests and all(url.startswith("file://") for url in o.requests), o.requests
    o.page.close()


def top_keys(page, panel: str = "top-keys", which: str = "top-keys-list") -> list[tuple[int, str, str]]:
    return page.eval_on_selector_all(f"[data-testid={panel}] [data-testid={which}] li",
                                     "els => els.map(e => [Number(e.dataset.key), e.className, "
                                     "e.querySelector('.w').textContent])")


def showing(page, layer: int, head: int) -> None:
    page.locator(f"html[data-shown='{layer}:{head}']").wait_for(state="attached")


def test_strongest_keys_are_the_keys_a_query_may_see(runner, tmp_path, context):
    """A causal query 1 of 12 sees 2 keys: its list was padded to 10 with `(masked) 0.0000`, and "show all" repeated
    it. Now the list holds the keys the mask allows, as F.scaled_dot_product_attention weighs them, and "show all"
    is offered only where the list leaves keys out (the last query: 12 keys, 10 listed)."""
    n = 12
    args = ["sdpa", "--batch", "1", "--nq", str(n), "--nk", str(n), "--dk", "4", "--dv", "4", "--causal", "--values"]
    payload = run(runner, args, tmp_path / "sdpa.html")
    tensors = {t["name"]: torch.tensor(t["values"], dtype=torch.float64) for t in payload["tensors"]
               if t["name"] in ("Q", "K")}
    Q, K = tensors["Q"][0], tensors["K"][0]  # the reference: a float64 causal softmax of the same inputs
    scores = (Q @ K.T / 2.0).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    o = open_page(context, tmp_path / "sdpa.html")
    page = o.page
    decimals = page.evaluate("JSON.parse(document.getElementById('attnscope-meta').textContent).decimals")
    tokens = page.get_by_test_id("query-token")
    tokens.nth(1).click()
    shown = top_keys(page)
    assert sorted(k for k, _, _ in shown) == [0, 1] and all(cls != "masked" for _, cls, _ in shown), shown
    for key, _, text in shown:
        assert abs(float(text) - float(weights[1, key])) <= 0.5 * 10.0 ** -decimals + 1e-9
    assert page.get_by_test_id("show-all").count() == 0
    tokens.nth(n - 1).click()
    shown = top_keys(page)
    assert [k for k, _, _ in shown] == weights[n - 1].argsort(descending=True, stable=True)[:10].tolist() or \
        len(shown) == 10  # ties at the page's decimals may order differently
    page.get_by_test_id("show-all").click()
    every = top_keys(page, which="all-keys-list")
    assert [k for k, _, _ in every] == list(range(n))
    finish(o)


def test_a_run_without_layers_says_its_rows_are_batch_elements(runner, tmp_path, context):
    """mha (and trace, sdpa) pages: the kinds grid's rows are batch elements, and it was headed "every layer, every
    head"."""
    args = ["mha", "--batch", "2", "--nq", "6", "--d-feat", "16", "--heads", "4", "--causal", "--all-heads"]
    run(runner, args, tmp_path / "mha.html")
    o = open_page(context, tmp_path / "mha.html")
    page = o.page
    heading = page.locator("#layers").text_content()
    assert heading.startswith("every batch element, every head") and "every layer" not in heading
    assert page.locator('nav a[href="#layers"]').text_content() == "every batch element"
    grid = page.get_by_test_id("kinds-grid")
    assert "rows are batch elements" in grid.get_attribute("aria-label")
    assert grid.locator("tbody th").all_inner_texts() == ["batch element 0", "batch element 1"]
    finish(o)


def _click_label(page, testid: str, row: int) -> None:
    """A click on row `row`'s label, left of the cells (the canvas says where its cells start)."""
    canvas = page.get_by_test_id(testid)
    canvas.scroll_into_view_if_needed()
    box, at = canvas.bounding_box(), canvas.evaluate("c => c.dataset")
    page.mouse.click(box["x"] + float(at["left"]) / 2, box["y"] + float(at["top"]) + (row + 0.5) * float(at["cell"]))


def test_model_page_tokens_decode_labels_and_how_to_read(runner, tmp_path, context):
    """A byte-level BPE model (tiny Qwen2): the query tokens read as the tokenizer decodes each (`␣cat`, as the
    terminal shows them), not `Ġcat`; clicking a decode row's label picks that step, and a query's label that query;
    "how to read this" names every kind the heads table uses, induction included."""
    from transformers import AutoTokenizer

    folder = tmp_path / "qwen2"
    build("qwen2", folder)
    args = ["head", "--model", str(folder), "--layer", "1", "--head", "0", "--text", SENTENCE, "--generate", "3",
            "--all-heads"]
    payload = run(runner, args, tmp_path / "qwen2.html")
    theirs = AutoTokenizer.from_pretrained(folder)
    o = open_page(context, tmp_path / "qwen2.html")
    page = o.page
    shown = page.get_by_test_id("query-token").all_inner_texts()
    expected = [theirs.decode([i]) for i in payload["token_ids"]]
    assert shown == [re.sub(" ", "␣", text) or "∅" for text in expected]
    assert any(text.startswith("␣") for text in shown) and not any("Ġ" in text for text in shown)
    assert payload["token_text"] == expected

    steps = payload["decode_steps"]
    _click_label(page, "decode-timeline", 2)
    title = page.get_by_test_id("decode-keys").locator("h4").inner_text()
    assert title.startswith("step 2: “") and f"at position {steps[2]['position']}" in title
    assert page.get_by_test_id("decode-steps").locator("tbody tr").nth(2).get_attribute("class").endswith("selected")
    text = steps[2]["text"]  # the terminal's label: the text, or the token where the text is part of a character
    assert title.split("“")[1].split("”")[0] == (steps[2]["token"] if "\ufffd" in text else text.replace(" ", "␣"))

    _click_label(page, "heatmap", 3)
    assert page.get_by_test_id("top-keys").locator("h4").inner_text().startswith("query 3 ")

    how = page.get_by_test_id("how-to-read").text_content()
    for kind in KINDS:
        assert kind in how, kind
    finish(o)


def test_the_image_overlay_has_a_colour_scale(tmp_path, context, monkeypatch):
    """The overlay painted each patch from clear to bright with nothing to read its colours by: a scale under it
    now runs from 0 (clear) to the row's largest weight on a patch (from --json's attention), its bright end
    viridis' last colour (#fde725) at the overlay's opacity over the page."""
    from cli_main import run_main
    from tiny_vision import build as build_vision
    from tiny_vision import draw

    build_vision("dinov2_with_registers", tmp_path / "model")
    draw(tmp_path / "cat.png", 96, 80)
    monkeypatch.chdir(tmp_path)
    args = ["head", "--model", "model", "--image", "cat.png", "--layer", "1", "--head", "2"]
    data = run_main(*args, "--json").json()
    assert run_main(*args, "--html", "page.html").code == 0
    o = open_page(context, tmp_path / "page.html")
    page = o.page
    scale = page.get_by_test_id("overlay-scale")
    assert scale.is_visible()
    first = data["image"]["first_patch"]
    row = data["attention"][0][first:first + data["image"]["n_patches"]]  # [CLS]'s row over the patches
    top = float(scale.get_attribute("data-max"))
    assert abs(top - max(row)) <= 0.5 * 10.0 ** -(len(scale.get_attribute("data-max").split(".")[1])) + 1e-9
    assert scale.get_attribute("data-min") == "0"
    alpha = float(scale.get_attribute("data-alpha"))
    if page.evaluate("document.documentElement.dataset.theme") == "dark":
        page.get_by_test_id("theme-toggle").click()  # the light page: its background is white
    ends = scale.evaluate("""c => { const x = c.getContext('2d'), r = devicePixelRatio;
        const at = (px) => Array.from(x.getImageData(Math.round(px * r), Math.round(8 * r), 1, 1).data.slice(0, 3));
        return [at(2), at(c.clientWidth - 3)]; }""")
    background = [255, 255, 255]
    bright = [alpha * c + (1 - alpha) * b for c, b in zip((0xfd, 0xe7, 0x25), background, strict=True)]
    assert all(abs(a - b) <= 3 for a, b in zip(ends[1], bright, strict=True)), ends
    assert all(abs(a - b) <= 3 for a, b in zip(ends[0], background, strict=True)), ends
    title = page.get_by_test_id("overlay-title").inner_text()
    assert f"0 (clear) to {scale.get_attribute('data-max')} (bright)" in title
    finish(o)


BUGGY = '''import torch


def attention(query, key, value):
    """Scores divided by d_k, not its square root: a bug trace finds."""
    scores = torch.matmul(query, key.transpose(-2, -1)) / query.size(-1)
    p_attn = scores.softmax(dim=-1)
    return torch.matmul(p_attn, value), p_attn
'''


def test_trace_page_shows_the_reference_and_the_difference(runner, tmp_path, context):
    """The trace page drew only the user's attention. Now the selector also holds the reference's, and
    |yours - reference|: each row as a float64 softmax of the same inputs gives it."""
    import numpy as np

    g = torch.Generator().manual_seed(5)
    Q, K, V = (torch.randn(2, n, 8, generator=g) * 1.5 for n in (4, 6, 6))
    for name, t in (("q", Q), ("k", K), ("v", V)):
        np.save(tmp_path / f"{name}.npy", t.numpy())
    (tmp_path / "buggy.py").write_text(BUGGY, encoding="utf-8")
    args = ["trace", f"{tmp_path / 'buggy.py'}:attention", "--q", str(tmp_path / "q.npy"), "--k",
            str(tmp_path / "k.npy"), "--v", str(tmp_path / "v.npy"), "--html", str(tmp_path / "trace.html")]
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and (tmp_path / "trace.html").is_file(), result.output  # exit 1: a bug
    scores = Q.double() @ K.double().transpose(-2, -1)
    reference = torch.softmax(scores / 8 ** 0.5, dim=-1)  # [2, 4, 6]
    yours = torch.softmax(scores / 8, dim=-1)
    o = open_page(context, tmp_path / "trace.html")
    page = o.page
    decimals = page.evaluate("JSON.parse(document.getElementById('attnscope-meta').textContent).decimals")
    layers = page.get_by_test_id("layer-select")
    labels = layers.locator("option").all_inner_texts()
    assert labels == ["batch element 0", "batch element 1", "reference: batch element 0",
                      "reference: batch element 1", "|yours - reference|: batch element 0",
                      "|yours - reference|: batch element 1"]
    for label, truth in (("batch element 1", yours), ("reference: batch element 1", reference),
                         ("|yours - reference|: batch element 1", (yours - reference).abs())):
        layers.select_option(label=label)
        showing(page, labels.index(label), 0)
        for i in range(4):
            page.get_by_test_id("query-token").nth(i).click()
            shown = top_keys(page)
            assert len(shown) == 6
            for key, _, text in shown:
                assert abs(float(text) - float(truth[1, i, key])) <= 0.5 * 10.0 ** -decimals + 1e-6, (label, i, key)
    assert "|yours - reference|" in page.get_by_test_id("pattern-title").inner_text()
    finish(o)
