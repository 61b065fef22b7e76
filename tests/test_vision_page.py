"""The page of `head --image` in a real browser (tests/browser.py): the image under the query's weights, the
query picked by clicking a patch or a token apart from the image ([CLS], registers), and every number shown
held against --json of the same run. `ATTNSCOPE_SCREENSHOTS=DIR` writes the overlay's screenshot there
(docs/images/vision-page.png is one).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from browser import browser, chromium, open_page
from cli_main import run_main
from tiny_vision import build, draw

CHROMIUM = chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found (apt-get install chromium, or set "
                                                          "ATTNSCOPE_CHROMIUM): the page is tested in a real browser")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-page")
    build("dinov2_with_registers", root / "model")
    draw(root / "cat.png", 96, 80)
    here = os.getcwd()
    os.chdir(root)  # the paths as a user types them, as the page shows them
    try:
        args = ["head", "--model", "model", "--image", "cat.png", "--layer", "1", "--head", "2"]
        data = run_main(*args, "--json").json()
        assert run_main(*args, "--html", "page.html").code == 0
        every = run_main(*args, "--all-layers", "--json").json()
        assert run_main(*args, "--all-layers", "--html", "every.html").code == 0
    finally:
        os.chdir(here)
    return data, root / "page.html", every, root / "every.html"


def _weight_on_patches(title: str) -> float:
    found = re.search(r": ([0-9.]+) of its weight on the 4 × 4 patches", title)
    assert found, title
    return float(found.group(1))


def test_overlay_picks_queries(made):
    data, path, _, _ = made
    attention = data["attention"]  # [n_tokens, n_tokens], head 2 of layer 1
    assert CHROMIUM is not None
    with browser(CHROMIUM) as context:
        opened = open_page(context, path)
        page = opened.page
        assert not opened.errors and opened.requests == [path.resolve().as_uri()]
        box = page.locator("[data-testid=image-overlay]")
        assert box.is_visible()
        title = page.inner_text("[data-testid=overlay-title]")
        assert title.startswith("query 0 “[CLS]”") and "layer 1, head 2" in title
        assert page.locator("[data-testid=overlay-mode]").is_hidden()  # no rollout without --all-layers
        assert _weight_on_patches(title) == pytest.approx(sum(attention[0][3:]), abs=2e-3)
        buttons = page.locator("[data-testid=overlay-token]")
        assert buttons.all_inner_texts()[1].startswith("reg0 ")
        assert float(buttons.all_inner_texts()[1].split()[1]) == pytest.approx(attention[0][1], abs=1e-3)
        canvas = page.locator("[data-testid=overlay-canvas]")
        canvas.scroll_into_view_if_needed()
        where = canvas.bounding_box()
        page.mouse.click(where["x"] + where["width"] * 0.9, where["y"] + where["height"] * 0.1)  # row 0, column 3
        title = page.inner_text("[data-testid=overlay-title]")
        assert title.startswith("query 6 “p(0,3)”"), title  # [CLS], reg0, reg1, then p(0,0)..p(0,3)
        assert _weight_on_patches(title) == pytest.approx(sum(attention[6][3:]), abs=2e-3)
        assert "p(0,3)" in page.inner_text("[data-testid=top-keys]")  # the heatmap's query follows
        canvas.focus()
        page.keyboard.press("ArrowDown")  # the arrows walk the grid: p(1,3), then p(1,2)
        page.keyboard.press("ArrowLeft")
        title = page.inner_text("[data-testid=overlay-title]")
        assert title.startswith("query 9 “p(1,2)”"), title
        assert _weight_on_patches(title) == pytest.approx(sum(attention[9][3:]), abs=2e-3)
        assert page.locator("[data-testid=head-select]").input_value() == "2"  # the arrows left the head alone
        buttons.nth(2).click()
        assert page.inner_text("[data-testid=overlay-title]").startswith("query 2 “reg1”")
        shots = os.environ.get("ATTNSCOPE_SCREENSHOTS")
        if shots:
            page.mouse.click(where["x"] + where["width"] * 0.1, where["y"] + where["height"] * 0.1)
            box.screenshot(path=str(Path(shots) / "vision-page.png"))


def test_rollout_over_the_image(made):
    """With --all-layers the overlay switches to the rollout's row of the same query, as --json's rollout."""
    _, _, data, path = made
    rollout = data["rollout"]  # [n_tokens, n_tokens]
    assert CHROMIUM is not None
    with browser(CHROMIUM) as context:
        opened = open_page(context, path)
        page = opened.page
        assert not opened.errors
        page.locator("[data-testid=overlay-mode]").click()
        title = page.inner_text("[data-testid=overlay-title]")
        assert title.startswith("query 0 “[CLS]”") and "rollout up to layer 1" in title, title
        assert _weight_on_patches(title) == pytest.approx(sum(rollout[0][3:]), abs=2e-3)
        page.locator("[data-testid=overlay-token]").nth(1).click()  # reg0 as the query
        title = page.inner_text("[data-testid=overlay-title]")
        assert title.startswith("query 1 “reg0”") and "rollout" in title
        assert _weight_on_patches(title) == pytest.approx(sum(rollout[1][3:]), abs=2e-3)
        page.locator("[data-testid=overlay-mode]").click()
        assert "layer 1, head 2" in page.inner_text("[data-testid=overlay-title]")
