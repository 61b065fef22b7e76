"""What the readings of issue 34 cost (docs/heads.md: value-weighted attention, sink shares, rollout):
`attnscope head --all-layers` on the 1.1B LLaMA-shaped checkpoint of bench_model_text.py with the readings, and
the same run with them switched off, in turns, fresh processes (docs/performance.md).

    python benchmarks/bench_readings.py [--runs 5] [--model DIR] [--at COMMIT]

The readings are always on in attnscope; "without" runs the same command line through a wrapper that replaces
them with nothing (the stream's value norms, layer L's steps, the rollouts, the sinks grid and their JSON), and
"with" through the same wrapper leaving them in, so both pay the same start-up. Target (issue 44): with <= 1.05x
without, as the terminal's grid and as --json. `--model`: a 1.1B checkpoint already built, in place of the cache's;
`--at`: the package at that commit (`git archive`) in place of this tree's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, copy_package, interleaved_medians, machine  # noqa: E402
from bench_layers import TEXT  # noqa: E402
from bench_model_text import llama_1b  # noqa: E402

# argv[1]: "on" or "off"; the rest: attnscope's own arguments.
WRAPPER = """
import sys
if sys.path[0] == "":
    del sys.path[0]  # not the folder it runs in: the package on PYTHONPATH (--at), else the installed one
if sys.argv[1] == "off":
    import attnscope.readings.moved as moved
    import attnscope.render.model as model
    import attnscope.render.readings as readings
    import attnscope.runs.beyond_layer as layers
    moved.layer_norms = lambda *args, **kwargs: None
    moved.traced_readings = lambda *args, **kwargs: None
    layers.rollouts = lambda result: None
    readings.layer_readings = lambda layer: {}
    readings.head_readings = lambda heads: [{} for _ in heads.heads]
    model.readings_json = lambda result: {}
    model.show_moved = model.show_sinks = model.show_rollout = lambda *args: None
sys.argv = ["attnscope", *sys.argv[2:]]
from attnscope.cli import run
run()
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--model", type=Path, help="the 1.1B checkpoint's folder (default: built once in the cache)")
    parser.add_argument("--at", metavar="COMMIT", help="time the package at COMMIT in place of this tree's")
    args = parser.parse_args()
    folder = args.model or llama_1b()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    tmp = tempfile.TemporaryDirectory()
    if args.at:
        env["PYTHONPATH"] = copy_package(Path(tmp.name) / "at", args.at)
    assert shutil.which(PYTHON)
    print(f"machine: {machine()}; median of {args.runs} runs after 1 warm-up, fresh process each, in turns\n")
    print("| measurement | readings | median wall (s) | median peak RSS (MiB) | with / without |")
    print("|---|---|---|---|---|")
    base = ["head", "--model", str(folder), "--layer", "1", "--head", "0", "--text", TEXT, "--all-layers"]
    for label, extra in (("--all-layers, the grid in the terminal", []), ("--all-layers --json", ["--json"])):
        commands = {mode: [PYTHON, "-c", WRAPPER, mode, *base, *extra] for mode in ("off", "on")}
        got = interleaved_medians(commands, runs=args.runs, env=env)
        off, on = got["off"], got["on"]
        for mode, sample in (("without", off), ("with", on)):
            ratio = f"{on.seconds / off.seconds:.2f}x time, {on.peak_mib / off.peak_mib:.2f}x memory"
            shown = ratio if mode == "with" else ""
            print(f"| {label}, LLaMA 1.1B | {mode} | {sample.seconds:.2f} | {sample.peak_mib:.0f} | {shown} |",
                  flush=True)


if __name__ == "__main__":
    main()
