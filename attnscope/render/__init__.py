"""Everything the user sees: Rich tables, heatmaps, and the JSON export. The only package that imports rich.

Output reads the same with NO_COLOR=1 and when piped: colour is never the only carrier of meaning
(heatmaps use shade characters, PASS/FAIL are words). Modules: console (the console, errors, JSON),
tables (steps, statistics, checks), results (an sdpa/mha run), heatmap, model (head and bert), bench.
"""

from attnscope.render.bench import bench_estimate, bench_json, progress_bar, show_bench
from attnscope.render.console import clean, console, emit_json, error, finite, info
from attnscope.render.model import head_json, show_head
from attnscope.render.results import result_json, show_result

__all__ = ["bench_estimate", "bench_json", "clean", "console", "emit_json", "error", "finite", "head_json", "info",
           "progress_bar", "result_json", "show_bench", "show_head", "show_result"]
