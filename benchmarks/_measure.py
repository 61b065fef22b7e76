"""Shared by the benchmarks: run a command in a fresh process, N times, and keep the medians.

Wall time is measured around the whole process (start-up included: that is what a user waits for);
peak memory is the child's own peak resident set (`ru_maxrss` from wait4), so each run is measured
alone, in a process that did nothing else.

Keep the measuring process itself small: Linux folds the forked child's copy of the parent's memory
into the child's ru_maxrss at exec, so a parent that has imported torch (or built a model) would put
its own size into every measurement. Heavy set-up work goes into subprocesses (`python_output`).
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Sample:
    seconds: float
    peak_mib: float


def run_once(argv: list[str], env: dict[str, str] | None = None, codes: tuple[int, ...] = (0,)) -> Sample:
    """One run of `argv` in a fresh process; `codes`: the exit codes it may end with (`attnscope trace` exits 1 where
    it names a mistake)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) not in codes:
        raise SystemExit(f"benchmark command failed: {' '.join(argv)}\n{stderr}")
    return Sample(elapsed, usage.ru_maxrss / 1024)  # ru_maxrss is KiB on Linux


def medians(argv: list[str], runs: int, warmup: int = 1, env: dict[str, str] | None = None) -> Sample:
    for _ in range(warmup):  # the first run pays for cold file caches; it is not what users see twice
        run_once(argv, env)
    samples = [run_once(argv, env) for _ in range(runs)]
    return Sample(statistics.median(s.seconds for s in samples), statistics.median(s.peak_mib for s in samples))


def interleaved_medians(commands: dict[str, list[str]], runs: int, warmup: int = 1,
                        env: dict[str, str] | None = None) -> dict[str, Sample]:
    """Run the commands in turn, round after round, so a slow moment of the machine hits them all alike."""
    for argv in commands.values():
        for _ in range(warmup):
            run_once(argv, env)
    samples: dict[str, list[Sample]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, argv in commands.items():
            samples[name].append(run_once(argv, env))
    return {name: Sample(statistics.median(s.seconds for s in got), statistics.median(s.peak_mib for s in got))
            for name, got in samples.items()}


def python_output(code: str, *args: str) -> str:
    """Run Python code in a subprocess (so its imports never swell this process) and return its stdout."""
    return subprocess.run([PYTHON, "-c", code, *args], check=True, capture_output=True, text=True).stdout.strip()


def machine() -> str:
    torch_version = python_output("import torch; print(torch.__version__)")
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch_version}, "
            f"{platform.system()} {platform.release()}")


PYTHON = sys.executable


PACKAGE = Path(__file__).resolve().parent.parent / "attnscope"


def copy_package(into: Path, commit: str | None = None) -> str:
    """The package as it is now (or at `commit`), without bytecode; returns the folder to put on PYTHONPATH."""
    if commit is None:
        shutil.copytree(PACKAGE, into / "attnscope", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
        into.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(PACKAGE.parent), "archive", commit, "attnscope"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return str(into)
