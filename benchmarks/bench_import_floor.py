"""The import floor (issue 44, goal 5): one head, `attnscope head --model DIR --layer L --head H` with and without
`--text`, against `python -c "import torch, safetensors, tokenizers"`, whether or not bytecode is cached.

Target: one head at most 1.15x the floor in every bytecode case. With --text, a head imports what the floor imports
(torch, safetensors, tokenizers) and runs layers 0..L; without it, it reads the head's slices alone (no torch).
The commands run in turn, round after round, as fresh processes; medians and ratios come from one run. Wall time is
the target's measure; the CPU time (user + system, from wait4) is printed beside it because on a loaded machine the
wall is mostly waiting.

    python benchmarks/bench_import_floor.py [--runs 5] [--only tiny|1b] [--modules] [--before COMMIT] [--at COMMIT]

The attnscope measured is a copy of this tree's package, taken when the script starts (so an edit made while it
runs changes nothing), or with --at the package at that commit (`git archive`: a tree others are editing need not
import), put first on PYTHONPATH; with --before, a copy of the package at that commit is timed in the same rounds.
Three bytecode cases, each with its own copies:
- cached: bytecode written on the untimed warm-up and read after, as a regular install (pip compiles every module
  it installs, `attnscope/**/__pycache__` included) or a second run of an editable one;
- attnscope not cached: PYTHONDONTWRITEBYTECODE=1 and no `__pycache__` in the copy, so attnscope's modules are
  compiled on every run while the libraries' come from their install's bytecode (an editable tree where
  PYTHONDONTWRITEBYTECODE is set, as on this machine);
- nothing cached: PYTHONDONTWRITEBYTECODE=1 and an empty PYTHONPYCACHEPREFIX, so every module of both commands,
  torch's too, is compiled on every run.
Checkpoints: the tiny LLaMA of bench_layers.py (2 layers, width 64, random weights, its own tokenizer) and the 1.1B
LLaMA of bench_model_text.py (16 layers, 4.4 GB); both written once to ~/.cache/attnscope-bench. `--modules` also
prints how many modules each command imports (-X importtime's lines) and of which packages, beyond the floor's.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, copy_package, machine  # noqa: E402

FLOOR = "import torch, safetensors, tokenizers"
TARGET = 1.15

TEXT = "The cat sat on the mat because it was tired, and the dog ran after it."


def cases(tmp: Path) -> dict[str, dict[str, str]]:
    """Each bytecode case's environment, without its PYTHONPATH (the copy measured)."""
    base = {key: value for key, value in os.environ.items()
            if key not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX", "PYTHONPATH")}
    base.update(HF_HUB_OFFLINE="1", NO_COLOR="1")
    (tmp / "prefix").mkdir()
    return {"cached": base,
            "attnscope not cached": {**base, "PYTHONDONTWRITEBYTECODE": "1"},
            "nothing cached": {**base, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(tmp / "prefix")}}


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (user + system) and peak RSS (MiB) of one fresh process."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        stderr = proc.stderr.read().decode() if proc.stderr else ""
        raise SystemExit(f"benchmark command failed: {' '.join(argv)}\n{stderr}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def interleaved(commands: dict[str, tuple[list[str], dict[str, str]]], runs: int) -> dict[str, tuple[float, ...]]:
    """Each command's medians (wall, CPU, RSS): one untimed warm-up each (it writes the bytecode where it is
    written), then the commands in turn, round after round."""
    for argv, env in commands.values():
        run_once(argv, env)
    got: dict[str, list[tuple[float, float, float]]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, (argv, env) in commands.items():
            got[name].append(run_once(argv, env))
    return {name: tuple(statistics.median(x[i] for x in samples) for i in range(3)) for name, samples in got.items()}


def imported(argv: list[str], env: dict[str, str]) -> collections.Counter[str]:
    """Modules a command imports (-X importtime's lines), counted by top-level package."""
    done = subprocess.run([PYTHON, "-X", "importtime", *argv], env=env, capture_output=True, text=True, check=True)
    names = [line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
             if line.startswith("import time:") and "|" in line and not line.rstrip().endswith("imported package")]
    return collections.Counter(name.split(".")[0] for name in names)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", choices=("tiny", "1b"))
    parser.add_argument("--modules", action="store_true")
    parser.add_argument("--before", metavar="COMMIT", help="also time each --text head with the package at COMMIT")
    parser.add_argument("--at", metavar="COMMIT", help="time the package at COMMIT in place of this tree's")
    args = parser.parse_args()
    attnscope = shutil.which("attnscope") or f"{Path(PYTHON).parent}/attnscope"
    print(f"machine: {machine()}; median of {args.runs} interleaved runs after 1 warm-up, fresh process each\n")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        checkpoints = {}
        if args.only in (None, "tiny"):
            from bench_layers import tiny_llama

            checkpoints["tiny LLaMA"] = (tiny_llama(), "1", "2")
        if args.only in (None, "1b"):
            from bench_model_text import llama_1b

            checkpoints["1.1B LLaMA"] = (llama_1b(), "1", "17")
        heads = {}
        for label, (folder, layer, head) in checkpoints.items():
            argv = [attnscope, "head", "--model", str(folder), "--layer", layer, "--head", head]
            heads[f"{label}, `head --layer {layer} --head {head}`"] = argv
            heads[f"{label}, the same `--text` (layers 0..{layer} run)"] = [*argv, "--text", TEXT]
        floor = f'python -c "{FLOOR}"'
        print("| bytecode | command | wall (s) | vs the floor | CPU (s) | vs the floor | peak RSS (MiB) |")
        print("|---|---|---|---|---|---|---|")
        worst, envs = [0.0, 0.0], cases(tmp)
        for i, (case, env) in enumerate(envs.items()):
            now = {**env, "PYTHONPATH": copy_package(tmp / f"now{i}", args.at)}
            commands = {floor: ([PYTHON, "-c", FLOOR], now), **{label: (argv, now) for label, argv in heads.items()}}
            if args.before:
                then = {**env, "PYTHONPATH": copy_package(tmp / f"before{i}", args.before)}
                commands.update({f"{label} at {args.before}": (argv, then) for label, argv in heads.items()
                                 if "--text" in argv})
            results = interleaved(commands, args.runs)
            for label, (wall, cpu, rss) in results.items():
                ratios = wall / results[floor][0], cpu / results[floor][1]
                if label in heads:
                    worst = [max(w, r) for w, r in zip(worst, ratios, strict=True)]
                print(f"| {case} | {label} | {wall:.2f} | {ratios[0]:.2f}x | {cpu:.2f} | {ratios[1]:.2f}x | "
                      f"{rss:.0f} |")
        print(f"\nworst ratio of a head: {worst[0]:.2f}x the wall, {worst[1]:.2f}x the CPU time (target <= {TARGET}x)")
        if args.modules:
            env = {**envs["cached"], "PYTHONPATH": str(tmp / "now0")}
            floor_modules = imported(["-c", FLOOR], env)
            for label, argv in {floor: [PYTHON, "-c", FLOOR], **heads}.items():
                counts = imported(argv[1:] if argv[0] == PYTHON else argv, env)
                beyond = counts - floor_modules
                top = ", ".join(f"{package} {n}" for package, n in beyond.most_common(6))
                print(f"{label}: {sum(counts.values())} modules, {sum(beyond.values())} beyond the floor ({top})")


if __name__ == "__main__":
    main()
