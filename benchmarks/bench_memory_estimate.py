"""The memory guard's estimate against the measured peak of real runs. Target: within 25%.

Each run is a fresh `attnscope ... --json` process; its peak resident set beyond that of a tiny run of
the same command is the measured peak, and `totals.peak_bytes` of its JSON is the estimate (the guard
uses the same number, from the sizes alone: tests/test_cost.py holds the two equal).

    python benchmarks/bench_memory_estimate.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, machine  # noqa: E402

CASES = [
    ["sdpa", "--batch", "16", "--nq", "1024", "--nk", "1024", "--dk", "64", "--dv", "64"],
    ["sdpa", "--batch", "16", "--nq", "1024", "--nk", "1024", "--dk", "64", "--dv", "64", "--causal"],
    ["sdpa", "--batch", "4", "--nq", "2048", "--nk", "4096", "--dk", "128", "--dv", "128"],
    ["sdpa", "--batch", "2", "--nq", "4096", "--nk", "4096", "--dk", "64", "--dv", "64", "--pad", "100"],
    ["mha", "--batch", "16", "--nq", "512", "--d-feat", "512", "--heads", "8"],
    ["mha", "--batch", "16", "--nq", "512", "--d-feat", "512", "--heads", "8", "--causal"],
    ["mha", "--batch", "8", "--nq", "256", "--nk", "1024", "--d-feat", "1024", "--heads", "16"],
    ["mha", "--batch", "4", "--nq", "1024", "--d-feat", "768", "--heads", "12"],
]
TINY = {"sdpa": ["sdpa", "--batch", "1", "--nq", "1", "--nk", "1", "--dk", "1", "--dv", "1"],
        "mha": ["mha", "--batch", "1", "--nq", "1", "--d-feat", "8", "--heads", "1"]}


def peak(attnscope: str, args: list[str]) -> tuple[int, dict]:
    proc = subprocess.Popen([attnscope, *args, "--json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out = proc.stdout.read() if proc.stdout else b""
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: attnscope {' '.join(args)}")
    return usage.ru_maxrss * 1024, json.loads(out)


def main() -> None:
    attnscope = shutil.which("attnscope") or f"{Path(PYTHON).parent}/attnscope"
    baseline = {name: min(peak(attnscope, args)[0] for _ in range(3)) for name, args in TINY.items()}
    print(f"machine: {machine()}\n")
    print("| run | measured peak (MiB) | estimate (MiB) | estimate / measured |")
    print("|---|---|---|---|")
    worst = 0.0
    for args in CASES:
        measured, payload = peak(attnscope, args)
        used = measured - baseline[args[0]]
        estimate = payload["totals"]["peak_bytes"]
        worst = max(worst, abs(estimate / used - 1))
        print(f"| `attnscope {' '.join(args)}` | {used / 2**20:.0f} | {estimate / 2**20:.0f} | {estimate / used:.3f} |")
    print(f"\nlargest deviation: {worst:.1%} (target: within 25%)")


if __name__ == "__main__":
    main()
