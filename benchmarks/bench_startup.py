"""Start-up: `attnscope --help` and a default `attnscope sdpa` against `python -c "import torch"`.

Targets: --help at most 0.25x and a default sdpa at most 1.35x the time of importing torch. The three
commands run in turn, round after round, as fresh processes; medians and ratios come from one run.

    python benchmarks/bench_startup.py [--runs 15]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, interleaved_medians, machine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    attnscope = shutil.which("attnscope") or f"{Path(PYTHON).parent}/attnscope"
    env = {**os.environ, "NO_COLOR": "1"}
    results = interleaved_medians({
        'python -c "import torch"': [PYTHON, "-c", "import torch"],
        "attnscope --help": [attnscope, "--help"],
        "attnscope sdpa --help": [attnscope, "sdpa", "--help"],
        "attnscope sdpa (default run)": [attnscope, "sdpa"],
    }, runs=args.runs, env=env)
    torch_s = results['python -c "import torch"'].seconds
    targets = {"attnscope --help": 0.25, "attnscope sdpa --help": 0.25, "attnscope sdpa (default run)": 1.35}
    print(f"machine: {machine()}; median of {args.runs} interleaved runs after 1 warm-up, fresh process each\n")
    print("| command | median wall (s) | vs import torch | target |")
    print("|---|---|---|---|")
    for name, sample in results.items():
        target = f"<= {targets[name]}x" if name in targets else "(reference)"
        print(f"| `{name}` | {sample.seconds:.3f} | {sample.seconds / torch_s:.2f}x | {target} |")


if __name__ == "__main__":
    main()
