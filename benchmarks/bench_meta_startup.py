"""`--meta` against the real run, and what importing torch's compiler cost: fresh processes, before and after.

Target: `mha --d-feat 64 --heads 4 --meta` never slower than the same run without --meta. Before
attnscope/tensors/metadevice.py, the meta device's Python kernels imported sympy and torch._dynamo on the first op
(F.linear's bias through the addmm decomposition, whose torch.mm is wrapped by `torch._disable_dynamo`), and
`--check` with a lower-right mask imported torch.nn.attention.bias, which imports torch._dynamo too. Each
command runs in turn, round after round, as a fresh process with a fresh TMPDIR; with `--before DIR` (a
checkout of the code before the change, e.g. `git archive main | tar -x -C DIR`) every command also runs on
that code, interleaved, so before and after meet the same machine. The first rows time, in a fresh process after
torch's import, one F.linear with a bias on meta tensors without and with `shapes_only`, and attnscope's own
part of the real and the --meta run.

    python benchmarks/bench_meta_startup.py [--runs 7] [--before DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, interleaved_medians, machine, python_output  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OWN = """
import time, torch, sys
from attnscope.runs.mha import MhaOptions, run_mha
start = time.perf_counter()
run_mha(MhaOptions(d_feat=64, heads=4, meta=sys.argv[1] == "meta"))
print(time.perf_counter() - start)
"""
LINEAR = """
import time, torch, sys
x, w, b = (torch.empty(s, device="meta") for s in ((8, 32, 64), (64, 64), (64,)))
start = time.perf_counter()
if sys.argv[1] == "mode":
    from attnscope.tensors.metadevice import shapes_only
    with shapes_only():
        torch.nn.functional.linear(x, w, b)
else:
    torch.nn.functional.linear(x, w, b)
print(time.perf_counter() - start)
"""


def _inner(code: str, mode: str, runs: int, env: dict[str, str]) -> float:
    """Median seconds of what `code` times after torch's import, each run in a fresh process."""
    import statistics
    import subprocess

    times = [float(subprocess.run([PYTHON, "-c", code, mode], check=True, capture_output=True, text=True,
                                  env=env).stdout) for _ in range(runs)]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--before", help="a checkout of the code before the change, to run the same commands on")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    python_output(f"import numpy as np; np.save({str(work / 'q.npy')!r}, np.ones((2, 5, 8), np.float32))")
    commands = {
        "mha --d-feat 64 --heads 4": ["mha", "--d-feat", "64", "--heads", "4"],
        "mha --d-feat 64 --heads 4 --meta": ["mha", "--d-feat", "64", "--heads", "4", "--meta"],
        "mha --q q.npy --heads 2 (a shadow run on meta sizes it)": ["mha", "--q", str(work / "q.npy"), "--heads", "2"],
        "sdpa --nq 4 --nk 6 --causal lower-right --check": ["sdpa", "--nq", "4", "--nk", "6", "--causal",
                                                            "lower-right", "--check"],
    }
    trees = {"after": str(ROOT), **({"before": str(Path(args.before).resolve())} if args.before else {})}
    env = {**os.environ, "NO_COLOR": "1", "TMPDIR": str(work)}
    runs = {f"{tree}: {name}": [PYTHON, "-c", f"import sys; sys.path.insert(0, {path!r}); "
                                "from attnscope.cli import main; main()", *argv]
            for name, argv in commands.items() for tree, path in trees.items()}
    results = interleaved_medians(runs, runs=args.runs, env=env)
    env_after = {**env, "PYTHONPATH": str(ROOT)}
    plain, mode = _inner(LINEAR, "plain", args.runs, env_after), _inner(LINEAR, "mode", args.runs, env_after)
    own = {kind: _inner(OWN, kind, args.runs, env_after) for kind in ("real", "meta")}
    print(f"machine: {machine()}; median of {args.runs} interleaved runs after 1 warm-up, fresh process each\n")
    print("| command | median wall (s) |")
    print("|---|---|")
    print(f"| one F.linear with a bias on meta tensors, plain torch (first call, import excluded) | {plain:.3f} |")
    print(f"| the same under attnscope.tensors.metadevice.shapes_only | {mode:.3f} |")
    print(f"| run_mha(d_feat=64, heads=4), torch imported: the real run | {own['real']:.3f} |")
    print(f"| the same with meta=True | {own['meta']:.3f} |")
    for name, sample in results.items():
        print(f"| `{name}` | {sample.seconds:.2f} |")
    for tree in trees:
        real = results[f"{tree}: mha --d-feat 64 --heads 4"].seconds
        meta = results[f"{tree}: mha --d-feat 64 --heads 4 --meta"].seconds
        print(f"\n{tree}: --meta / real run = {meta / real:.2f} (target: <= 1)")


if __name__ == "__main__":
    main()
