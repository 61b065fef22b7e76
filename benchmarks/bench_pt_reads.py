"""A `.pt` file named by several flags of one command is unpickled and mapped once (tensors/opened.py;
docs/performance.md).

    python benchmarks/bench_pt_reads.py [--runs 5] [--mib 200] [--before DIR]

A float32 tensor of about `--mib` MiB, `[n_batch, 8, 256]` (8 queries and keys a batch, so that the attention's
own arithmetic stays small beside the file), saved with torch.save in a temporary folder, then
`attnscope sdpa --q x.pt --k x.pt --v x.pt` (--json, so no table of its statistics is drawn), and the same with
--meta (headers only). Each command runs as a fresh process, in turns, medians of wall time and peak RSS (see
_measure.py); torch.load is counted in one more run of each.

`--before DIR` runs the same commands a second time on another attnscope source tree (on PYTHONPATH, the same
Python), e.g. the tree before the change: `git archive eb2d729^ attnscope | tar -x -C DIR`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, interleaved_medians, machine, python_output  # noqa: E402

# argv[1]: where the file goes, argv[2]: its size in MiB.
WRITE = """
import sys, torch
n_batch = int(sys.argv[2]) * 2**20 // (8 * 256 * 4)
torch.save(torch.randn(n_batch, 8, 256, generator=torch.Generator().manual_seed(0)), sys.argv[1])
print(n_batch)
"""

# argv: attnscope's own arguments; prints how many times torch.load ran.
COUNTED = """
import sys, torch
calls = []
real = torch.load
torch.load = lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)
sys.argv = ["attnscope", *sys.argv[1:]]
from attnscope.cli import main
try:
    main()
except SystemExit as exc:
    assert not exc.code, exc.code
print(len(calls), file=sys.stderr)
"""


def loads(argv: list[str], env: dict[str, str]) -> int:
    import subprocess

    done = subprocess.run([PYTHON, "-P", "-c", COUNTED, *argv], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"benchmark command failed: {' '.join(argv)}\n{done.stderr}")
    return int(done.stderr.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mib", type=int, default=200)
    parser.add_argument("--before", type=Path, help="another attnscope source tree to run the same commands on")
    args = parser.parse_args()
    trees = {"now": None, **({"before": args.before.resolve()} if args.before else {})}
    with tempfile.TemporaryDirectory() as folder:
        file = str(Path(folder) / "x.pt")
        n_batch = python_output(WRITE, file, str(args.mib))
        size = Path(file).stat().st_size / 2**20
        print(f"machine: {machine()}; x.pt [{n_batch}, 8, 256] float32, {size:.0f} MiB; median of {args.runs} runs "
              "after 1 warm-up, fresh process each, in turns\n")
        print("| command | tree | torch.load calls | median wall (s) | median peak RSS (MiB) |")
        print("|---|---|---|---|---|")
        sdpa = ["sdpa", "--q", file, "--k", file, "--v", file, "--json"]
        for label, argv in (("sdpa --q x.pt --k x.pt --v x.pt --json", sdpa),
                            ("the same with --meta", [*sdpa, "--meta"])):
            commands, counts = {}, {}
            for tree, where in trees.items():
                env = {**os.environ, "NO_COLOR": "1", **({"PYTHONPATH": str(where)} if where else {})}
                counts[tree] = loads(argv, env)
                commands[tree] = ["env", *(f"{k}={v}" for k, v in env.items() if k in ("PYTHONPATH", "NO_COLOR")),
                                  PYTHON, "-P", "-c", "from attnscope.cli import run; run()", *argv]
            got = interleaved_medians(commands, args.runs)
            for tree, sample in got.items():
                print(f"| {label} | {tree} | {counts[tree]} | {sample.seconds:.2f} | {sample.peak_mib:.0f} |",
                      flush=True)


if __name__ == "__main__":
    main()
