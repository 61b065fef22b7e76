"""The explorer page (`--html`, attnscope/views/explorer.py) at its largest expected size: all-MiniLM-L6-v2's
every layer and head (6 x 12) at 512 tokens, its patterns from transformers' eager `BertModel` with
`output_attentions=True` (tests/page_data.py; `--all-layers` will make the same page from the command line).

    python benchmarks/bench_page.py [--runs 5] [--tokens 512]

Measured, medians of --runs rounds (after one warm-up for the browser):

- the reference: transformers' forward with output_attentions on the same text (its time is the scale);
- building the page's data (every head's statistics and kind: attnscope/headstats.py) and writing the page
  (`page_html`: quantizing, packing, compressing; views/packing.py);
- the page's size on disk, and what its data would take at 4 decimals (base64; the page gives up a decimal
  past 14 MB of data);
- in headless Chromium (Debian's, through Playwright; tests/browser.py), from file://: time to interactive,
  from navigation to the page saying it is ready (its data for the first layer read, heatmap, tokens, grid of
  heads and statistics drawn, controls live), a fresh tab each round; and the time from choosing another layer
  (or the same one, for a page of one layer) and clicking a query token to its strongest keys being shown.

Two pages: every layer, and layer 5 alone (what `bert --text ... --html` writes at 512 tokens).

Targets (issue 22): the page <= 15 MB, interactive within 3 s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tests"))
from _measure import machine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    from browser import chromium

    executable = chromium()
    if executable is None:
        raise SystemExit("bench_page: no Chromium found (apt-get install chromium, or set ATTNSCOPE_CHROMIUM)")
    print(machine())
    rows = [measure(executable, args.tokens, args.runs, layers) for layers in (range(6), [5])]
    median = statistics.median
    print(f"\n(medians of {args.runs} rounds; {args.tokens} tokens, 12 heads a layer)\n")
    print("| page | weights to | data at 4 decimals (MB) | transformers forward (s) | page data (s) | page_html (s) | "
          "size (MB) | interactive (s) | page's own clock (s) | other layer + query (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, decimals, at_4, forward, data, write, size, ready, own, switch in rows:
        print(f"| {name} | {decimals} decimals | {at_4 / 1e6:.2f} | {median(forward):.2f} | {median(data):.2f} | "
              f"{median(write):.2f} | {size / 1e6:.2f} | {median(ready):.2f} | {median(own):.2f} | "
              f"{median(switch):.2f} |")


def measure(executable: str, tokens: int, runs: int, layers: Sequence[int]) -> tuple[Any, ...]:
    from browser import browser, open_page
    from page_data import minilm_attentions, minilm_page

    from attnscope.views.explorer import page_html
    from attnscope.views.packing import Packer

    forward, data, write = [], [], []
    for _ in range(runs):
        labels, attentions, seconds = minilm_attentions(tokens)
        forward.append(seconds)
        start = time.perf_counter()
        page = minilm_page(tokens, (labels, attentions, seconds), layers)
        data.append(time.perf_counter() - start)
        start = time.perf_counter()
        text = page_html(page)
        write.append(time.perf_counter() - start)
    other = "1" if len(layers) > 1 else "0"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "minilm.html"
        path.write_text(text, encoding="utf-8")
        size = path.stat().st_size
        ready, own, switch = [], [], []
        with browser(executable) as context:
            for round_ in range(runs + 1):
                opened = open_page(context, path)
                tab = opened.page
                start = time.perf_counter()
                tab.get_by_test_id("layer-select").select_option(other)
                tab.locator(f"html[data-shown='{other}:0']").wait_for(state="attached")
                tab.get_by_test_id("query-token").nth(200).click()
                tab.get_by_test_id("top-keys").get_by_text("query 200 ").wait_for()
                if round_:  # the first round warms the browser up
                    switch.append(time.perf_counter() - start)
                    ready.append(opened.seconds)
                    own.append(tab.evaluate("window.attnscopeReady") / 1000)
                assert not opened.errors, opened.errors
                tab.close()
    decimals = text.split('"decimals":', 1)[1].split(",", 1)[0]
    packer = Packer(exp=-4)  # what the data would take at 4 decimals, for the record
    for layer in page.layers:  # type: ignore[attr-defined]
        for head in layer.heads:
            packer.add(str(layer.layer), head.attention)
    at_4 = sum(map(len, packer.blobs().values()))
    name = "every layer (6)" if len(layers) > 1 else f"one layer (layer {layers[0]}), as `bert --text --html`"
    return name, decimals, at_4, forward, data, write, size, ready, own, switch


if __name__ == "__main__":
    main()
