"""`attnscope bench`'s peak-memory column, checked two ways. Target: within 25% of attnscope's estimate.

1. Against the estimate: the traced contender's inputs plus its measured peak (what `bench` prints) over
   `estimate_bytes` (cost.sdpa_bytes / cost.mha_bytes, what the memory guard uses).
2. Against an independent measurement: every contender again, each alone in a fresh process, where the
   growth of the resident set during one call (peak RSS, reset just before it) is what the call touched.
   glibc's mmap threshold is pinned there, so freed blocks go back to the system and a call cannot hide in
   memory an earlier call left behind (the reason bench no longer measures this way in-process).

    python benchmarks/bench_bench_memory.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, machine, python_output  # noqa: E402

CASES = [
    ["sdpa"],
    ["sdpa", "--batch", "4", "--nq", "2048", "--nk", "2048", "--causal"],
    ["sdpa", "--batch", "2", "--nq", "512", "--nk", "4096", "--dk", "128", "--dv", "128"],
    ["mha"],
    ["mha", "--batch", "8", "--nq", "512", "--d-feat", "768", "--heads", "12", "--causal"],
    ["mha", "--batch", "4", "--nq", "128", "--nk", "1024", "--d-feat", "1024", "--heads", "16"],
]

ALONE = r"""
import ctypes, json, sys
from pathlib import Path
ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: big frees go back to the system
import torch
from attnscope.runs import race as bench
params, index = json.loads(sys.argv[1]), int(sys.argv[2])
sizes = {k: params[k] for k in params if k not in ("device", "dtype", "causal", "runs", "warmup", "batch_shape")}
race = (bench.sdpa_race if "dk" in params else bench.mha_race)(**sizes, causal=params["causal"], device="cpu",
                                                                dtype="float32")
fn = list(race.candidates.values())[index]
def status(field):
    return next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines()
                if l.startswith(field + ":"))
with torch.no_grad():
    fn()  # lazy initialisation (thread pools, kernels) is not the call's memory
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident set to the current one
    before = status("VmRSS")
    out = fn()
    print(status("VmHWM") - before)
"""


def main() -> None:
    attnscope = shutil.which("attnscope") or f"{Path(PYTHON).parent}/attnscope"
    print(f"machine: {machine()}\n")
    print("| bench | contender | bench's peak (MiB) | alone in a process (MiB) | ratio | with inputs (MiB) | "
          "estimate (MiB) | estimate / measured |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for args in CASES:
        out = subprocess.run([attnscope, "bench", *args, "--runs", "1", "--warmup", "0", "--json"],
                             capture_output=True, text=True, check=True).stdout
        result = json.loads(out)
        for index, contender in enumerate(result["contenders"]):
            alone = int(python_output(ALONE, json.dumps(result["params"]), str(index)))
            peak = contender["peak_bytes"]
            row = f"| `bench {' '.join(args)}` | {contender['name']} | {peak / 2**20:.1f} | {alone / 2**20:.1f} | "
            row += f"{peak / max(alone, 1):.2f} |"
            if index == 0:  # the traced path: attnscope's estimate covers it, inputs and weights included
                total = result["inputs_bytes"] + peak
                ratio = result["estimate_bytes"] / total
                worst = max(worst, abs(ratio - 1))
                row += f" {total / 2**20:.1f} | {result['estimate_bytes'] / 2**20:.1f} | {ratio:.3f} |"
            else:
                row += " | | |"
            print(row)
    print(f"\nlargest deviation of the estimate from bench's measured traced peak: {worst:.1%} (target: within 25%)")


if __name__ == "__main__":
    main()
