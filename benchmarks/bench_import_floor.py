"""The import floor (issue 44, goal 5): one head, `attnscope head --model DIR --layer L --head H` with and without
`--text`, against `python -c "import torch, safetensors, tokenizers"`, whether or not bytecode is cached.

Target: one head at most 1.15x the floor in every bytecode case. With --text, a head imports what the floor imports
(torch, safetensors, tokenizers) and runs layers 0..L; without it, it reads the head's slices alone (no torch). The commands run in turn, round after round,
as fresh processes (see _measure.py); medians and ratios come from one run.

    python benchmarks/bench_import_floor.py [--runs 5] [--only tiny|1b] [--modules]

The attnscope measured is a copy of this tree's package, taken when the script starts (so an edit made while it
runs changes nothing), put first on PYTHONPATH. Three bytecode cases, each with its own copy:
- cached: bytecode written on the untimed warm-up and read after, as a regular install (pip compiles every module
  it installs, `attnscope/**/__pycache__` included) or a second run of an editable one;
- attnscope not cached: PYTHONDONTWRITEBYTECODE=1 and no `__pycache__` in the copy, so attnscope's modules are
  compiled on every run while the libraries' come from their install's bytecode (an editable tree where
  PYTHONDONTWRITEBYTECODE is set, as on this machine);
- nothing cached: PYTHONDONTWRITEBYTECODE=1 and an empty PYTHONPYCACHEPREFIX, so every module of both commands,
  torch's too, is compiled on every run.
Checkpoints: the tiny LLaMA of bench_layers.py (2 layers, width 64, random weights, its own tokenizer) and the 1.1B
LLaMA of bench_model_text.py (16 layers, 4.4 GB); both written once to ~/.cache/attnscope-bench. `--modules` also prints how many
modules each command imports (`sys.modules` at exit, read with -X importtime) and of which packages.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, interleaved_medians, machine, python_output  # noqa: E402

FLOOR = "import torch, safetensors, tokenizers"
TARGET = 1.15
PACKAGE = Path(__file__).resolve().parent.parent / "attnscope"

TEXT = "The cat sat on the mat because it was tired, and the dog ran after it."


def copy_package(into: Path) -> Path:
    """The package as it is now, without bytecode; returns the folder to put on PYTHONPATH."""
    shutil.copytree(PACKAGE, into / "attnscope", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return into


def cases(tmp: Path) -> dict[str, dict[str, str]]:
    base = {key: value for key, value in os.environ.items()
            if key not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX", "PYTHONPATH")}
    base.update(HF_HUB_OFFLINE="1", NO_COLOR="1")
    (tmp / "prefix").mkdir()
    return {
        "cached": {**base, "PYTHONPATH": str(copy_package(tmp / "cached"))},
        "attnscope not cached": {**base, "PYTHONPATH": str(copy_package(tmp / "dev")), "PYTHONDONTWRITEBYTECODE": "1"},
        "nothing cached": {**base, "PYTHONPATH": str(copy_package(tmp / "none")), "PYTHONDONTWRITEBYTECODE": "1",
                           "PYTHONPYCACHEPREFIX": str(tmp / "prefix")},
    }


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
        commands = {f'python -c "{FLOOR}"': [PYTHON, "-c", FLOOR], **heads}
        print("| bytecode | command | median wall (s) | median peak RSS (MiB) | vs the floor |")
        print("|---|---|---|---|---|")
        worst, envs = 0.0, cases(tmp)
        for case, env in envs.items():
            results = interleaved_medians(commands, runs=args.runs, env=env)
            floor = next(iter(results.values())).seconds
            for label, sample in results.items():
                ratio = sample.seconds / floor
                worst = max(worst, ratio) if label in heads else worst
                print(f"| {case} | {label} | {sample.seconds:.3f} | {sample.peak_mib:.0f} | {ratio:.2f}x |")
        print(f"\nworst ratio {worst:.2f}x (target <= {TARGET}x)")
        if args.modules:
            env = envs["cached"]
            floor_modules = imported(commands[next(iter(commands))][1:], env)
            for label, argv in commands.items():
                counts = imported(argv[1:] if argv[0] == PYTHON else argv, env)
                beyond = counts - floor_modules
                top = ", ".join(f"{package} {n}" for package, n in beyond.most_common(6))
                print(f"{label}: {sum(counts.values())} modules, {sum(beyond.values())} beyond the floor ({top})")


if __name__ == "__main__":
    main()
