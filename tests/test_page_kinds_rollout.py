"""Issue 43, items 9 and 10 on the page as in the terminal: a head that fits two kinds shows both
("first-token + induction", the table's words), and the rollout picker offers the rollout with the first token left
out (`rollout_without_first` of --json), drawn as the JSON gives it. In a real browser (tests/test_page.py's way)."""

from __future__ import annotations

import pytest
from browser import browser
from test_page import CHROMIUM, assert_shows, finish, opened, run, shown_keys
from tiny_models import build

from attnscope.readings import headstats

TEXT = "The cat sat on the mat. The cat sat on the mat because it was tired."
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found: the page is tested in a real browser")


@pytest.fixture(scope="module")
def context():
    assert CHROMIUM is not None
    with browser(CHROMIUM) as ctx:
        yield ctx


def test_second_kind_and_rollout_without_first_token(runner, tmp_path, context, monkeypatch):
    folder = tmp_path / "llama"
    build("llama", folder)
    real = headstats.kind_also
    # a tiny random model's heads rarely fit two kinds: every head here is read as also "induction" where it is not
    monkeypatch.setattr(headstats, "kind_also",
                        lambda stats, grid=None: real(stats, grid) or (
                            "induction" if headstats.kind(stats, grid) not in (None, "induction") else None))
    page_file = tmp_path / "page.html"
    payload = run(runner, ["head", "--model", str(folder), "--layer", "1", "--head", "0", "--text", TEXT,
                           "--all-layers"], page_file)
    o = opened(context, page_file)
    page = o.page
    page.decimals = o.decimals
    shown = payload["all_layers"][int(page.get_by_test_id("layer-select").input_value())]
    both = [(h, kind, also) for h, (kind, also) in enumerate(zip(shown["kinds"], shown["kinds_also"], strict=True))
            if kind and also]
    assert both, shown
    options = page.eval_on_selector_all("[data-testid=head-select] option", "els => els.map(e => e.textContent)")
    for h, kind, also in both:
        assert f"head {h} · {kind} + {also}" in options, options
    kinds = page.eval_on_selector_all("[data-testid=rollout-kind] option", "els => els.map(e => e.value)")
    assert kinds == ["rollout", "rollout_weighted", "rollout_without_first"][:len(kinds)] and \
        "rollout_without_first" in kinds
    n = len(payload["tokens"])
    page.get_by_test_id("rollout-kind").select_option("rollout_without_first")
    page.wait_for_function("document.querySelector('[data-testid=rollout-bars] .muted').textContent"
                           ".includes('first token left out')")
    assert_shows(shown_keys(page, "rollout-bars"), payload["rollout_without_first"][n - 1], page.decimals)
    finish(o)
