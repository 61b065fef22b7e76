"""Every example a user can paste (README.md, docs/*.md, every --help epilog), timed as a fresh process.

The examples and the folder each runs in come from tests/examples.py, as in tests/test_examples.py: the
tensor files they name, `./my-bert` and the hub names through a temporary Hugging Face cache, offline.
Target: every example finishes in seconds on a 2-core CPU. Prints the slowest first, as Markdown.

    python benchmarks/bench_examples.py [--runs 3] [--top 12]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests"), str(ROOT)]
from _measure import PYTHON, machine  # noqa: E402
from examples import Example, all_examples, model_names, prepare, provide_models  # noqa: E402

from attnscope.cli import app  # noqa: E402  (typer only: this process stays small)


def timed(attnscope: str, example: Example, folder: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run([attnscope, *example.args], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=600)
    seconds = time.perf_counter() - start
    if (done.returncode == example.status) != (example.error is None):
        raise SystemExit(f"{example.where}: `{example.line}` exited {done.returncode}\n{done.stderr}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    options = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # building the stand-in models, quietly
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    attnscope = shutil.which("attnscope") or f"{Path(PYTHON).parent}/attnscope"
    examples = all_examples(app)
    models = model_names(app, examples)
    with tempfile.TemporaryDirectory() as tmp:
        hub, folders = provide_models(Path(tmp), models)
        env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "COLUMNS": "100"}
        times: dict[Example, float] = {}
        for n, example in enumerate(examples):
            samples = []
            for run in range(options.runs + 1):  # the first run warms the file caches; it is not kept
                folder = Path(tmp) / f"example-{n}-{run}"
                prepare(folder, example, folders)
                samples.append(timed(attnscope, example, folder, env))
            times[example] = statistics.median(samples[1:])
    ranked = sorted(times.items(), key=lambda item: -item[1])
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f} at the end (0 to 2 is quiet on 2 CPUs)\n")
    print(f"{len(examples)} examples, median of {options.runs} runs each after 1 warm-up; total "
          f"{sum(times.values()):.1f} s, median {statistics.median(times.values()):.2f} s\n")
    print("| example | where | median wall (s) |")
    print("|---|---|---|")
    for example, seconds in ranked[: options.top]:
        print(f"| `{example.line}` | {example.where} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
