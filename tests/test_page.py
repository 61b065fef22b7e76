"""The explorer page (`--html` of sdpa, mha, head, bert, trace; attnscope/views/explorer.py) driven in a real
browser, as a person uses it: pick a layer and a head, click query tokens, hover, type, press keys; and what it
shows compared with `--json` of the same run (or, for `trace`, with PyTorch's softmax on the same inputs).
Every page must make no request beyond its own file and log no error.

Headless Chromium through Playwright (tests/browser.py). Skipped, with the reason, only where no Chromium is
installed (.ci/run installs Debian's).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from browser import browser, chromium, open_page
from tiny_models import SENTENCE, build

from attnscope.cli import app
from attnscope.views.explorer import KIND_LETTERS

ROOT = Path(__file__).resolve().parents[1]
MY_ATTENTION = str(ROOT / "docs" / "examples" / "my_attention.py")
CHROMIUM = chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found (apt-get install chromium, or set "
                                                          "ATTNSCOPE_CHROMIUM): the page is tested in a real browser")


@pytest.fixture(scope="module")
def context():
    assert CHROMIUM is not None
    with browser(CHROMIUM) as ctx:
        yield ctx


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert")
    build("bert", folder)
    return folder


def run(runner, args: list[str], html: Path) -> dict:
    """The command's --json, then the same run with --html (the page written)."""
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code in (0, 1), result.output
    written = runner.invoke(app, [*args, "--html", str(html)])
    assert written.exit_code == result.exit_code and html.is_file(), written.output
    return json.loads(result.stdout)


def opened(context, path: Path):
    page = open_page(context, path)
    page.decimals = page.page.evaluate("JSON.parse(document.getElementById('attnscope-meta').textContent).decimals")
    return page


def finish(o) -> None:
    """No request leaves the page's own file, nothing was logged as an error."""
    assert o.errors == []
    assert o.requests and all(url.startswith("file://") for url in o.requests), o.requests
    o.page.close()


def shown_keys(page, panel: str = "top-keys", which: str = "top-keys-list") -> list[tuple[int, str]]:
    return page.eval_on_selector_all(f"[data-testid={panel}] [data-testid={which}] li",
                                     "els => els.map(e => [Number(e.dataset.key), e.querySelector('.w').textContent])")


def showing(page, layer: int, head: int) -> None:
    """Wait until the page shows this layer and head (it reads a head's data before it shows any of it)."""
    page.locator(f"html[data-shown='{layer}:{head}']").wait_for(state="attached")


def hover(page, testid: str, i: int, j: int) -> None:
    """The mouse over cell (i, j) of a heatmap (the canvas says where its cells are)."""
    canvas = page.get_by_test_id(testid)
    canvas.scroll_into_view_if_needed()
    box, at = canvas.bounding_box(), canvas.evaluate("c => c.dataset")
    cell = float(at["cell"])
    page.mouse.move(box["x"] + float(at["left"]) + (j + 0.5) * cell, box["y"] + float(at["top"]) + (i + 0.5) * cell)


def assert_shows(shown: list[tuple[int, str]], row: list[float], decimals: int, top: int = 10) -> None:
    """The weights shown are the row's, to the decimals shown, and they are its strongest keys."""
    unit = 10.0 ** -decimals
    left_out = [j for j in range(len(row)) if j not in {k for k, _ in shown}]
    # a masked key (weight 0 by construction) never pads the list, so a causal row may list fewer
    assert len(shown) == min(top, len(row)) or (len(shown) < top and all(row[j] == 0 for j in left_out)), shown
    for key, text in shown:
        assert len(text.split(".")[1]) == decimals, text
        assert abs(float(text) - row[key]) <= unit / 2 + 1e-9, (key, text, row[key])
    keys = {k for k, _ in shown}
    assert min(row[k] for k in keys) >= max((row[j] for j in range(len(row)) if j not in keys), default=0) - unit


def test_mha_page_shows_the_json_weights_for_every_query(runner, tmp_path, context):
    args = ["mha", "--batch", "2", "--nq", "6", "--d-feat", "16", "--heads", "4", "--causal", "--all-heads",
            "--heatmap-batch", "1"]
    payload = run(runner, args, tmp_path / "mha.html")
    o = opened(context, tmp_path / "mha.html")
    page = o.page
    layers = page.get_by_test_id("layer-select")
    assert layers.locator("option").all_inner_texts() == ["batch element 0", "batch element 1"]
    assert layers.input_value() == "1"  # --heatmap-batch 1: the batch element --all-heads described
    page.get_by_test_id("head-select").select_option("2")
    showing(page, 1, 2)
    tokens = page.get_by_test_id("query-token")
    assert tokens.all_inner_texts() == [f"q{i}" for i in range(6)]
    attention = payload["heads"][2]["attention"]  # batch element 1, head 2
    for i in range(6):
        tokens.nth(i).click()
        assert page.get_by_test_id("top-keys").locator("h4").inner_text().startswith(f"query {i} ")
        assert_shows(shown_keys(page), attention[i], o.decimals)
    # the last query's 6 keys are all in its list: no "show all" to repeat them (tests/test_page_trust.py)
    assert page.get_by_test_id("show-all").count() == 0
    kinds = page.get_by_test_id("head-thumb").all_inner_texts()
    assert kinds == [f"head {h['head']}: {h['kind']}" for h in payload["heads"]]
    page.get_by_test_id("head-thumb").nth(3).click()  # the grid opens a head
    showing(page, 1, 3)
    assert page.get_by_test_id("head-select").input_value() == "3"
    stats = page.get_by_test_id("head-stats").locator("tbody tr").nth(3).locator("td").all_inner_texts()
    assert stats[:3] == ["3", payload["heads"][3]["kind"], f"{payload['heads'][3]['stats']['entropy']:.2f}"]
    finish(o)


def test_model_page_says_the_real_layer_and_shows_the_tokens(runner, tmp_path, tiny_bert, context):
    args = ["head", "--model", str(tiny_bert), "--layer", "1", "--head", "2", "--text", SENTENCE, "--all-heads"]
    payload = run(runner, args, tmp_path / "head.html")
    o = opened(context, tmp_path / "head.html")
    page = o.page
    assert page.get_by_test_id("layer-select").locator("option").all_inner_texts() == ["layer 1"]
    assert page.get_by_test_id("head-select").input_value() == "2"
    assert "layer 1, head 2" in page.get_by_test_id("pattern-title").inner_text()
    assert page.get_by_test_id("query-token").all_inner_texts() == payload["tokens"]
    for h in (2, 0):
        page.get_by_test_id("head-select").select_option(str(h))
        showing(page, 0, h)
        attention = payload["attention"] if h == 2 else payload["heads"][h]["attention"]
        for i in (0, 3, len(payload["tokens"]) - 1):
            page.get_by_test_id("query-token").nth(i).click()
            assert_shows(shown_keys(page), attention[i], o.decimals)
    weights = page.get_by_test_id("weights").locator("tbody tr td:first-child").all_inner_texts()
    assert weights == [t["name"] for t in payload["tensors"]]
    steps = page.get_by_test_id("steps").locator("tbody tr")
    assert steps.locator("td:first-child").all_inner_texts() == [s["name"] for s in payload["layer_steps"]]
    cells = steps.nth(0).locator("td")  # text left, numbers right, whatever a stylesheet around it says
    aligns = cells.evaluate_all("tds => tds.map(td => getComputedStyle(td).textAlign)")
    assert aligns == ["left", "left", "left", "left", "right", "right"]
    finish(o)


def test_trace_page_shows_the_users_attention(runner, tmp_path, context):
    g = torch.Generator().manual_seed(3)
    Q, K, V = (torch.randn(2, n, 8, generator=g) * 1.5 for n in (5, 7, 7))
    for name, t in (("q", Q), ("k", K), ("v", V)):
        np.save(tmp_path / f"{name}.npy", t.numpy())
    args = ["trace", f"{MY_ATTENTION}:attention", "--q", str(tmp_path / "q.npy"), "--k", str(tmp_path / "k.npy"),
            "--v", str(tmp_path / "v.npy")]
    run(runner, args, tmp_path / "trace.html")
    reference = torch.softmax(Q.double() @ K.double().transpose(-2, -1) / math.sqrt(8), dim=-1)  # [2, 5, 7]
    o = opened(context, tmp_path / "trace.html")
    page = o.page
    assert "every reference step has its equal" in page.locator(".verdict").inner_text()
    page.get_by_test_id("layer-select").select_option(label="batch element 1")
    showing(page, 1, 0)
    for i in range(5):
        page.get_by_test_id("query-token").nth(i).click()
        assert_shows(shown_keys(page), reference[1, i].tolist(), o.decimals, top=7)
    finish(o)


def test_sdpa_page_hover_keys_search_theme_and_column_layout(runner, tmp_path, context):
    args = ["sdpa", "--batch", "1", "--nq", "4", "--nk", "6", "--dk", "4", "--dv", "4", "--layout", "col",
            "--values"]
    payload = run(runner, args, tmp_path / "sdpa.html")
    attention = next(t for t in payload["tensors"] if t["name"] == "attention")
    assert attention["dims"][-2:] == ["n_K", "n_Q"]
    rows = np.array(attention["values"][0]).T.tolist()  # queries as rows, as the page draws them
    o = opened(context, tmp_path / "sdpa.html")
    page = o.page
    page.get_by_test_id("heatmap").focus()
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowDown")  # query 1
    assert page.get_by_test_id("query-token").nth(1).get_attribute("aria-pressed") == "true"
    assert_shows(shown_keys(page), rows[1], o.decimals, top=6)
    hover(page, "heatmap", 2, 4)  # the tooltip names the query and the key, and gives the weight
    where, weight = page.get_by_test_id("tooltip").inner_text().rsplit(": ", 1)
    assert where == "query 2 “q2” → key 4 “k4”" and abs(float(weight) - rows[2][4]) <= 0.5 * 10.0 ** -o.decimals + 1e-9
    search = page.get_by_test_id("token-search")
    search.fill("q2")
    assert page.locator("[data-testid=query-token].match").all_inner_texts() == ["q2"]
    search.press("Enter")
    assert page.get_by_test_id("query-token").nth(2).get_attribute("aria-pressed") == "true"
    theme = page.evaluate("document.documentElement.dataset.theme")
    page.get_by_test_id("theme-toggle").click()
    assert page.evaluate("document.documentElement.dataset.theme") != theme
    finish(o)


def synthetic() -> tuple[object, dict]:
    """What later commands fill (every layer, a pooled long input with exact rows, decode steps), made here:
    three layers numbered 2, 5 and 7; layer 7's head 1 pooled 3 x 3 with the exact row of query 4; three
    decode steps of two heads, the last with keys 0 and 1 evicted."""
    from attnscope.views.explorer import DecodeStep, Head, Layer, Page

    g = torch.Generator().manual_seed(1)
    n = 9

    def pattern(rows: int = n, cols: int = n) -> torch.Tensor:
        return torch.softmax(torch.randn(rows, cols, generator=g) * 2, dim=-1)

    long = pattern()
    pooled = long.reshape(3, 3, 3, 3).sum(-1).mean(1)  # queries averaged, keys summed, 3 by 3
    tokens = [f"w{i}" for i in range(n - 1)] + ["</script>&<b>"]  # a token is text, whatever it holds
    layers = [Layer(2, [Head(0, pattern(), "mixed", {"entropy": 1.0}), Head(1, pattern())]),
              Layer(5, [Head(0, pattern()), Head(1, pattern())]),
              Layer(7, [Head(0, pattern()), Head(1, None, attention_pooled=pooled, pool=(3, 3), rows={4: long[4]})])]
    steps = [DecodeStep(100 + t, f"new{t}", n + t, torch.softmax(torch.randn(2, n + t + 1, generator=g), -1),
                        1024 * (t + 1), [(0, 2)] if t == 2 else []) for t in range(3)]
    page = Page("synthetic", queries=tokens, keys=tokens, layers=layers, decode=steps, decode_layer=7)
    truth = {"layer5": layers[1].heads[1].attention, "pooled": pooled, "row4": long[4], "steps": steps}
    return page, truth


def test_every_layer_a_pooled_head_and_the_decode_timeline(tmp_path, context):
    from attnscope.views.explorer import page_html

    data, truth = synthetic()
    path = tmp_path / "synthetic.html"
    path.write_text(page_html(data), encoding="utf-8")
    o = opened(context, path)
    page = o.page
    layers = page.get_by_test_id("layer-select")
    assert layers.locator("option").all_inner_texts() == ["layer 2", "layer 5", "layer 7"]
    page.get_by_test_id("heatmap").focus()
    page.keyboard.press("PageDown")  # the next layer
    showing(page, 1, 0)
    assert layers.input_value() == "1" and page.get_by_test_id("pattern-title").inner_text().startswith("layer 5")
    page.keyboard.press("ArrowRight")  # the next head
    showing(page, 1, 1)
    page.get_by_test_id("query-token").nth(6).click()
    assert_shows(shown_keys(page), truth["layer5"][6].tolist(), o.decimals, top=9)
    layers.select_option(label="layer 7")
    showing(page, 2, 1)
    page.get_by_test_id("head-select").select_option("1")
    showing(page, 2, 1)
    assert "pooled: each cell = 3 queries × 3 keys" in page.get_by_test_id("pattern-title").inner_text()
    hover(page, "heatmap", 1, 2)  # queries 3-5, keys 6-8
    where, weight = page.get_by_test_id("tooltip").inner_text().rsplit(": ", 1)
    assert where == "queries 3–5 → keys 6–8" and abs(float(weight) - float(truth["pooled"][1, 2])) <= 0.5e-4 + 1e-9
    assert page.locator("[data-testid=query-token].exact").all_inner_texts() == ["w4"]
    assert page.get_by_test_id("query-token").nth(8).inner_text() == "</script>&<b>"
    page.get_by_test_id("query-token").nth(4).click()  # its exact row was kept
    assert_shows(shown_keys(page), truth["row4"].tolist(), o.decimals, top=9)
    page.get_by_test_id("query-token").nth(5).click()  # its was not
    assert "exact weights are not in the page" in page.get_by_test_id("top-keys").inner_text()
    decode = page.get_by_test_id("decode-steps").locator("tbody tr")
    assert decode.count() == 3
    assert decode.nth(2).locator("td").all_inner_texts() == ["2", "new2", "102", "11", "12", "3.0 KiB"]
    decode.nth(2).click()
    step = truth["steps"][2].attention[1].tolist()  # head 1, the head chosen above
    assert_shows(shown_keys(page, "decode-keys"), step, o.decimals)
    assert "layer 7, head 1" in page.locator("#decode-title").inner_text()
    finish(o)


def test_a_notebook_shows_the_page_where_scripts_run(context, tmp_path):
    from attnscope import sdpa

    trace = sdpa(torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 2), causal=True)
    path = tmp_path / "notebook.html"
    path.write_text(f"<!DOCTYPE html><html><body><div class='output'>{trace._repr_html_()}</div></body></html>",
                    encoding="utf-8")
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    frame = page.frame_locator("iframe[title='attnscope explorer']")
    frame.locator("html[data-ready='1']").wait_for(state="attached")
    assert frame.get_by_test_id("layer-select").locator("option").all_inner_texts() == ["batch element 0",
                                                                                         "batch element 1"]
    assert page.locator("svg").count() == 0  # the static view made way for the page
    assert errors == []
    page.close()


def test_a_long_page_of_every_layer_is_small_and_opens(tmp_path, context):
    """MiniLM's every layer and head at 512 tokens (transformers' eager BertModel, output_attentions): a loose
    sanity bound on the page's size and time to open (benchmarks/bench_page.py measures them)."""
    from page_data import minilm_page

    from attnscope.views.explorer import page_html

    path = tmp_path / "minilm.html"
    path.write_text(page_html(minilm_page(512)), encoding="utf-8")
    assert path.stat().st_size <= 15_000_000
    o = opened(context, path)
    assert o.seconds < 30
    assert o.page.get_by_test_id("layer-select").locator("option").all_inner_texts() == [f"layer {i}" for i in range(6)]
    assert o.page.get_by_test_id("query-token").count() == 512
    finish(o)


def test_every_layer_and_the_decode_timeline_of_a_real_run(runner, tmp_path, context):
    """`head --all-layers --generate`: every layer in the selector, each head's weights as --json's
    `all_layers`, each decode step's row as its `decode_steps`."""
    folder = tmp_path / "qwen2"
    build("qwen2", folder)
    args = ["head", "--model", str(folder), "--layer", "1", "--head", "2", "--text", SENTENCE, "--all-layers",
            "--generate", "3"]
    payload = run(runner, args, tmp_path / "all.html")
    o = opened(context, tmp_path / "all.html")
    page = o.page
    layers = page.get_by_test_id("layer-select")
    assert layers.locator("option").all_inner_texts() == [f"layer {i}" for i in range(len(payload["all_layers"]))]
    layers.select_option(label="layer 2")
    page.get_by_test_id("head-select").select_option("3")
    showing(page, 2, 3)
    for i in (0, 4, len(payload["tokens"]) - 1):
        page.get_by_test_id("query-token").nth(i).click()
        assert_shows(shown_keys(page), payload["all_layers"][2]["attention"][3][i], o.decimals)
    decode = page.get_by_test_id("decode-steps").locator("tbody tr")
    assert decode.count() == 3
    decode.nth(1).click()
    head = int(page.get_by_test_id("head-select").input_value())
    assert_shows(shown_keys(page, "decode-keys"), payload["decode_steps"][1]["attention"][head], o.decimals)
    # the heading follows the layer and head shown; the steps (layer 1's) and weights (head 2's) say whose they are
    title = page.get_by_test_id("page-title").inner_text()
    assert title.endswith(", layer 2, head 3") and page.title() == title
    notes = page.get_by_test_id("elsewhere-note")
    for table, whose in (("steps", "layer 1"), ("weights", "layer 1, head 2")):
        note = page.get_by_test_id(table).get_by_test_id("elsewhere-note").inner_text()
        assert note == f"this table is {whose}'s, as the run asked; the heatmap shows layer 2, head 3", note
    # every layer's kinds as letters, the terminal's; a click opens that head, and the heading and notes follow
    cells = page.get_by_test_id("kinds-grid").locator("tbody tr")
    assert cells.count() == len(payload["all_layers"])
    for li, entry in enumerate(payload["all_layers"]):
        assert cells.nth(li).locator("td").all_inner_texts() == [KIND_LETTERS[k] for k in entry["kinds"]]
    assert "F first-token" in page.get_by_test_id("kinds-legend").inner_text()
    cells.nth(1).locator("td").nth(2).click()
    showing(page, 1, 2)
    selected = page.get_by_test_id("kinds-grid").locator("td.selected")  # the head clicked, not its left neighbour
    assert selected.count() == 1
    assert (selected.get_attribute("data-layer"), selected.get_attribute("data-head")) == ("1", "2")
    assert page.get_by_test_id("page-title").inner_text().endswith(", layer 1, head 2")
    assert notes.evaluate_all("ns => ns.map(n => n.hidden)") == [True, True]
    assert page.locator("table.steps.elsewhere").count() == 0
    # the causal mask: the first query's later keys are hatched and say so
    hover(page, "heatmap", 0, len(payload["tokens"]) - 1)
    assert page.get_by_test_id("tooltip").inner_text().endswith(": masked (the mask forbids this key)")
    finish(o)


def test_a_masked_key_is_drawn_apart_from_an_allowed_weight_of_0(tmp_path, context):
    """A key the mask forbids is hatched; a key the query may see with weight 0 is the scale's dark end, in
    either theme; the colour bar and the title say what the hatch is."""
    from attnscope.views.explorer import Head, Layer, Page, page_html

    A = torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.2, 0.3, 0.5, 0], [0.5, 0.0, 0.25, 0.25]])
    masked = torch.ones(4, 4, dtype=torch.bool).triu(1)  # (3, 1) is allowed, with weight 0
    path = tmp_path / "masked.html"
    path.write_text(page_html(Page("masked", queries=list("abcd"), keys=list("abcd"),
                                   layers=[Layer(0, [Head(0, A, masked=masked)])])), encoding="utf-8")
    o = opened(context, path)
    page = o.page
    assert "hatched: keys the mask forbids" in page.get_by_test_id("pattern-title").inner_text()
    read = """([i, j]) => { const c = document.getElementById('heatmap'), d = c.dataset, r = devicePixelRatio;
      const x = Math.round((+d.left + j * +d.cell + 2) * r), y = Math.round((+d.top + i * +d.cell + 2) * r);
      const n = Math.floor((+d.cell - 4) * r), px = c.getContext('2d').getImageData(x, y, n, n).data, seen = new Set();
      for (let k = 0; k < px.length; k += 4) seen.add(px.slice(k, k + 3).join(','));
      return [...seen]; }"""
    for theme in ("light", "dark"):
        if page.evaluate("document.documentElement.dataset.theme") != theme:
            page.get_by_test_id("theme-toggle").click()
        zero, hatched = page.evaluate(read, [3, 1]), page.evaluate(read, [0, 3])
        assert zero == ["68,1,84"], zero  # viridis' dark end, whole
        assert len(hatched) >= 2 and "68,1,84" not in hatched, hatched  # lines on the background
        assert page.get_by_test_id("heatmap").evaluate("c => document.getElementById('colorbar').dataset.masked") == "1"
    hover(page, "heatmap", 3, 1)
    assert page.get_by_test_id("tooltip").inner_text().endswith("“b”: 0.0000")
    page.get_by_test_id("query-token").nth(1).click()  # its strongest keys: the two it may see, no masked one
    marks = page.get_by_test_id("top-keys-list").locator("li").evaluate_all("ls => ls.map(l => l.className)")
    assert marks == ["", ""] and page.get_by_test_id("show-all").count() == 0
    finish(o)
