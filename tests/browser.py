"""Driving the explorer page (attnscope/views/explorer.py) in a real browser: Debian's Chromium through
Playwright's Python API (Playwright's own browser download is not used: `executable_path` names the system's).

`chromium()` finds the browser (ATTNSCOPE_CHROMIUM, else `chromium` or `chromium-browser` on the PATH, else
/usr/bin/chromium); `browser()` starts it headless with a fresh profile and nothing of its own that goes to
the network; `Opened` is a page opened from file:// with what it logged and every request it made.
Used by tests/test_page.py and benchmarks/bench_page.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
READY = "document.documentElement.dataset.ready"  # the page sets it once its first pattern is drawn


def chromium() -> str | None:
    for candidate in (os.environ.get("ATTNSCOPE_CHROMIUM"), shutil.which("chromium"),
                      shutil.which("chromium-browser"), "/usr/bin/chromium"):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


@contextmanager
def browser(executable: str, width: int = 1280, height: int = 900) -> Iterator[Any]:
    """A headless Chromium context (Playwright's BrowserContext) with a fresh profile, closed afterwards."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="attnscope-chromium-") as profile, sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=executable, headless=True, args=ARGS, viewport={"width": width, "height": height})
        context.set_default_timeout(15_000)  # a step that waits longer has failed: say so, do not hang
        try:
            yield context
        finally:
            context.close()


@dataclass
class Opened:
    page: Any
    seconds: float  # from navigation to the page saying it is ready (its first pattern drawn, controls live)
    errors: list[str] = field(default_factory=list)  # console errors and uncaught exceptions
    requests: list[str] = field(default_factory=list)  # every URL the page asked for, its own included


def open_page(context: Any, path: Path, timeout_s: float = 60) -> Opened:
    page = context.new_page()
    opened = Opened(page, 0.0)
    page.on("console", lambda m: opened.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: opened.errors.append(str(e)))
    page.on("request", lambda r: opened.requests.append(r.url))
    start = time.perf_counter()
    page.goto(path.resolve().as_uri())
    page.locator("html[data-ready]").wait_for(state="attached", timeout=timeout_s * 1000)
    opened.seconds = time.perf_counter() - start
    assert page.evaluate(READY) == "1", page.inner_text("main")[:500]
    return opened
