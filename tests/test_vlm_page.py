"""The page of a vision-language model's `head --text ... --image` in a real browser (tests/browser.py): a text
query found by the token search, its weights drawn over the image, and the share the overlay states held against
--json's image_share for that query. `ATTNSCOPE_SCREENSHOTS=DIR` writes the overlay's screenshot there
(docs/images/vlm-page.png is one).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from browser import browser, chromium, open_page
from cli_main import run_main
from tiny_vlm import TEXT, build, image

CHROMIUM = chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found (apt-get install chromium, or set "
                                                          "ATTNSCOPE_CHROMIUM): the page is tested in a real browser")


def test_a_text_query_over_the_image(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the page names the image as given: cat.png
    build("gemma3", tmp_path / "model")
    image(tmp_path / "cat.png")
    args = ["head", "--model", str(tmp_path / "model"), "--text", TEXT, "--image", "cat.png", "--layer", "2",
            "--head", "1"]
    data = run_main(*args, "--json").json()
    page_file = tmp_path / "page.html"
    assert run_main(*args, "--html", str(page_file)).code == 0
    q = data["tokens"].index("▁mat")
    assert CHROMIUM is not None
    with browser(CHROMIUM) as context:
        opened = open_page(context, page_file)
        page = opened.page
        assert not opened.errors and opened.requests == [page_file.resolve().as_uri()]
        assert page.locator("[data-testid=image-overlay]").is_visible()
        last = len(data["tokens"]) - 1  # shown first: the last text query, which sees the whole image
        shown = [text.replace(" ", "␣") for text in data["token_text"]]  # each token decoded alone (issue 43)
        assert page.inner_text("[data-testid=overlay-title]").startswith(f"query {last} “{shown[last]}”")
        search = page.locator("[data-testid=token-search]")
        search.fill("mat")
        search.press("Enter")
        title = page.inner_text("[data-testid=overlay-title]")
        assert title.startswith(f"query {q} “␣mat”"), title  # `▁mat` as Gemma's tokenizer decodes it
        found = re.search(r": ([0-9.]+) of its weight on the 2 × 2 patches", title)
        assert found, title
        assert float(found.group(1)) == pytest.approx(data["image_share"][1][q], abs=2e-3)
        shots = os.environ.get("ATTNSCOPE_SCREENSHOTS")
        if shots:
            page.locator("[data-testid=image-overlay]").screenshot(path=str(Path(shots) / "vlm-page.png"))
