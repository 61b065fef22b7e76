"""`attnscope anatomy`: how long a whole command takes, start-up included, against reading the same config the
way transformers does (`AutoConfig.from_pretrained`, which imports torch), and against `attnscope --help`.

Targets: anatomy well under a second (at most 0.5 s wall here, at most 0.35x AutoConfig's time) for a folder, a
Hugging Face name found in the cache, and --json; a config with absurd sizes (num_hidden_layers 10^12,
num_attention_heads 10^30) refused in about the same time. Fresh processes, run in turn round after round;
medians and ratios from one run.

    python benchmarks/bench_anatomy.py [--runs 15]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, interleaved_medians, machine, python_output  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "configs"


def hub_cache(root: Path) -> Path:
    """A Hugging Face cache holding Qwen/Qwen3-0.6B's published config.json, in the cache's own layout."""
    repo = root / "hub" / "models--Qwen--Qwen3-0.6B"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((CONFIGS / "Qwen3-0.6B.json").read_text())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return root / "hub"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    attnscope = shutil.which("attnscope") or f"{Path(PYTHON).parent}/attnscope"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = root / "gemma"
        folder.mkdir()
        (folder / "config.json").write_text((CONFIGS / "gemma-3-1b-it.json").read_text())
        absurd = root / "absurd"
        absurd.mkdir()
        config = json.loads((CONFIGS / "Qwen3-0.6B.json").read_text())
        (absurd / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**12,
                                                        "num_attention_heads": 10**30}))
        env = {**os.environ, "NO_COLOR": "1", "HF_HUB_CACHE": str(hub_cache(root)), "HF_HUB_OFFLINE": "1"}
        refused = run_once_status([attnscope, "anatomy", str(absurd)], env)
        commands = {
            "AutoConfig.from_pretrained(folder)": [PYTHON, "-c", "import sys; from transformers import AutoConfig; "
                                                   "AutoConfig.from_pretrained(sys.argv[1])", str(folder)],
            "attnscope --help": [attnscope, "--help"],
            "attnscope anatomy FOLDER": [attnscope, "anatomy", str(folder)],
            "attnscope anatomy FOLDER --json": [attnscope, "anatomy", str(folder), "--json"],
            "attnscope anatomy Qwen/Qwen3-0.6B (cache)": [attnscope, "anatomy", "Qwen/Qwen3-0.6B"],
            "attnscope anatomy ABSURD (refused)": [PYTHON, "-c", REFUSED, attnscope, str(absurd)],
        }
        results = interleaved_medians(commands, runs=args.runs, env=env)
        inside = python_output(IN_PROCESS, str(folder))
    reference = results["AutoConfig.from_pretrained(folder)"].seconds
    print(f"machine: {machine()}; median of {args.runs} interleaved runs after 1 warm-up, fresh process each\n")
    print(f"the absurd config: exit {refused[0]}, {refused[1]!r}\n")
    print("| command | median wall (s) | vs AutoConfig | target |")
    print("|---|---|---|---|")
    for name, sample in results.items():
        target = "(reference)" if sample.seconds == reference else "<= 0.35x" if "anatomy" in name else ""
        print(f"| `{name}` | {sample.seconds:.3f} | {sample.seconds / reference:.2f}x | {target} |")
    print("\n(the refused run is timed inside a small Python wrapper that expects exit 2, which adds its own"
          " start-up of about 0.02 s)")
    print(f"\nin one process, after the imports: {inside}")


# What anatomy itself takes once the interpreter and the CLI's imports are there: reading and describing.
IN_PROCESS = """
import statistics, sys, time
from attnscope.anatomy.read import read_anatomy
from attnscope.render.anatomy import anatomy_json
times = []
for _ in range(50):
    start = time.perf_counter()
    anatomy_json(read_anatomy(sys.argv[1]))
    times.append(time.perf_counter() - start)
print(f"read_anatomy + anatomy_json, median of 50: {statistics.median(times) * 1000:.1f} ms")
"""

# The absurd config exits 2, which run_once would take for a failed benchmark: a wrapper that expects it.
REFUSED = ("import subprocess, sys; r = subprocess.run(sys.argv[1:2] + ['anatomy', sys.argv[2]], capture_output=True);"
           " sys.exit(0 if r.returncode == 2 else 1)")


def run_once_status(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    import subprocess

    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    return done.returncode, done.stderr.strip()


if __name__ == "__main__":
    main()
