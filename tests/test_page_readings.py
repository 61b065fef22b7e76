"""Issue 34 on the page: the sinks view (a layer x head grid of where each head parks its weight) and the rollout's
row picker, in a real browser, against --json of the same run (tests/test_page.py's way)."""

from __future__ import annotations

import pytest
from browser import browser
from test_page import CHROMIUM, assert_shows, finish, opened, run, showing, shown_keys
from tiny_models import build

TEXT = "The cat sat on the mat. The cat sat on the mat because it was tired."
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found: the page is tested in a real browser")


@pytest.fixture(scope="module")
def context():
    assert CHROMIUM is not None
    with browser(CHROMIUM) as ctx:
        yield ctx


def test_sinks_grid_and_rollout_picker_show_the_json(runner, tmp_path, context):
    folder = tmp_path / "gpt_oss"
    build("gpt_oss", folder)  # learned sinks: the grid offers the sink's weight too
    page_file = tmp_path / "page.html"
    payload = run(runner, ["head", "--model", str(folder), "--layer", "1", "--head", "2", "--text", TEXT,
                           "--all-layers"], page_file)
    o = opened(context, page_file)
    page, grid = o.page, payload["sinks_share"]
    page.decimals = o.decimals
    assert page.get_by_test_id("sinks-measure").input_value() == "parked"
    cells = page.eval_on_selector_all("[data-testid=sink-cell]", "els => els.map(e => [Number(e.dataset.layer), "
                                      "Number(e.dataset.head), e.textContent])")
    assert len(cells) == len(grid["layers"]) * len(grid["first"][0])
    for li, hi, text in cells:
        assert int(text) == round(100 * (grid["first"][li][hi] + grid["sink"][li][hi]))
    page.get_by_test_id("sinks-measure").select_option("weighted_first")
    texts = page.eval_on_selector_all("[data-testid=sink-cell]", "els => els.map(e => e.textContent)")
    assert [int(t) for t in texts] == [round(100 * v) for row in grid["weighted_first"] for v in row]
    page.locator("[data-testid=sink-cell][data-layer='2'][data-head='3']").click()  # opens that head
    showing(page, 2, 3)
    assert page.locator("[data-testid=sink-cell].picked").evaluate("td => td.dataset.layer + ':' + td.dataset.head") \
        == "2:3"
    # the rollout: the last query first, then any row, plain and value-weighted
    n = len(payload["tokens"])
    assert page.get_by_test_id("rollout-row").input_value() == str(n - 1)
    assert_shows(shown_keys(page, "rollout-bars"), payload["rollout"][n - 1], page.decimals)
    page.get_by_test_id("rollout-row").select_option("4")
    page.get_by_test_id("rollout-kind").select_option("rollout_weighted")
    page.wait_for_function("document.querySelector('[data-testid=rollout-bars] h4').textContent.startsWith('query 4')")
    page.wait_for_function("document.querySelector('[data-testid=rollout-bars] .muted').textContent.includes('value')")
    shown = shown_keys(page, "rollout-bars")
    assert all(float(w) == 0 for k, w in shown if k > 4)  # causal: query 4 draws from the first five tokens only
    assert_shows(shown, payload["rollout_weighted"][4], page.decimals)
    finish(o)
