"""Everything the user sees: Rich tables, heatmaps, and the JSON export. The only package that imports rich.

Output reads the same with NO_COLOR=1 and when piped: colour is never the only carrier of meaning
(heatmap cells are shade characters, painted on a perceptual scale where the terminal has 256 colours;
PASS/FAIL are words). Modules: console (the console, errors, JSON), fit (tables and text that fit the
width), tables (steps, statistics, checks), results (an sdpa/mha run), shading (one weight, one cell),
heatmap (one pattern), heads (every head: grid and table), model (head and bert), mask, bench, usertrace
(trace), anatomy, export (--svg and --html).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

# Imported here: `console` is both a function and its module's name, and a later `import attnscope.render.console`
# must find the function already bound.
from attnscope.render.console import clean, console, emit_json, error, finite, info

# The rest is imported when first used (PEP 562), so that a command imports only the views it shows: `head`
# never loads anatomy's, bench's or an sdpa run's tables.
_HOMES = {"anatomy_json": "anatomy", "show_anatomy": "anatomy", "bench_estimate": "bench", "bench_json": "bench",
          "progress_bar": "bench", "show_bench": "bench", "head_json": "model", "show_head": "model",
          "result_json": "results", "show_result": "results"}

if TYPE_CHECKING:
    from attnscope.render.anatomy import anatomy_json, show_anatomy
    from attnscope.render.bench import bench_estimate, bench_json, progress_bar, show_bench
    from attnscope.render.model import head_json, show_head
    from attnscope.render.results import result_json, show_result

__all__ = ["anatomy_json", "bench_estimate", "bench_json", "clean", "console", "emit_json", "error", "finite",
           "head_json", "info", "progress_bar", "result_json", "show_anatomy", "show_bench", "show_head", "show_result"]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(f"attnscope.render.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'attnscope.render' has no attribute {name!r}")
