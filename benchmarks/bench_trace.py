"""`attnscope trace`'s own wall on a few of the trace tests' styles, and what its mask-rank runs take of it
(runs/trace_maskranks.py: the code given a boolean mask in each other form it takes, up to 5 forms x 7
conventions, once the first run lines up). Each case in a fresh process, the cases in turns, the median of --runs
runs (after a warm-up each):

- wall:        `python -m attnscope trace STYLES:TARGET ... --json`, around the whole process (start-up included);
- mask ranks:  the same run in a child that times runs/trace_readings.other_forms (the mask-rank runs, all of
               them) and its own wall from its first line, so the share is read within one process.

    .venv/bin/python benchmarks/bench_trace.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, machine, run_once  # noqa: E402

TESTS = Path(__file__).resolve().parent.parent / "tests"
PAD = "{PAD}"  # the key padding file [2, 7] the round 25/26 mask tests write (True = a real token)
PADDED = ("--batch", "2", "--nq", "7", "--mask", PAD)
CASES = {  # name: (styles file, target, --init, options)
    "boolean mask, correct (BERT's extended mask)": (
        "trace_styles_round26_maskrank.py", "BertExtendingSelfAttention", None, PADDED),
    "boolean mask, correct (Pix2Struct, 2-D and 4-D)": (
        "trace_styles_round26_maskrank.py", "Pix2StructVisionLike", None, ("--scale", "1", *PADDED)),
    "boolean mask, plant in the 2-D branch": (
        "trace_styles_round26_maskrank.py", "DiffusersLikeAttention", "bug='mask2d_on_queries'", PADDED),
    "plant, no mask (scale left out)": ("trace_styles_round26_xlm.py", "KeyedCacheLayer", "bug='no_scale'",
                                        ("--causal",)),
    "decode step (cache of 3), correct": ("trace_styles_round26_xlm.py", "KeyedCacheLayer", None,
                                          ("--causal", "--cache", "3")),
}

CHILD = """
import sys, time
start = time.perf_counter()
import attnscope.runs.trace_readings as readings
spent = [0.0]
other_forms = readings.other_forms

def timed(*args, **kwargs):
    began = time.perf_counter()
    try:
        return other_forms(*args, **kwargs)
    finally:
        spent[0] += time.perf_counter() - began

readings.other_forms = timed
from attnscope.cli import main
out, sys.argv = sys.argv[1], ["attnscope", *sys.argv[2:]]
try:
    main()
except SystemExit as exc:
    code = exc.code
with open(out, "w") as f:
    f.write(f"{spent[0]} {time.perf_counter() - start} {code}")
"""


def argv_of(case: tuple, pad: str) -> list[str]:
    styles, target, init, options = case
    return ["trace", f"{TESTS / styles}:{target}", *(("--init", init) if init else ()),
            *(pad if o == PAD else o for o in options), "--json"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        pad = str(Path(folder) / "pad.npy")
        keep = "import numpy as np; p = np.ones((2, 7), dtype=bool); p[0, 5:] = False; p[1, 6:] = False; "
        run_once([PYTHON, "-c", keep + f"np.save({pad!r}, p)"])
        timing = str(Path(folder) / "spent.txt")
        walls: dict[str, list[float]] = {name: [] for name in CASES}
        shares: dict[str, list[tuple[float, float]]] = {name: [] for name in CASES}
        for case in CASES.values():  # warm-up: cold file caches
            run_once([PYTHON, "-m", "attnscope", *argv_of(case, pad)], codes=(0, 1))
        for _ in range(args.runs):
            for name, case in CASES.items():
                walls[name].append(run_once([PYTHON, "-m", "attnscope", *argv_of(case, pad)], codes=(0, 1)).seconds)
                run_once([PYTHON, "-c", CHILD, timing, *argv_of(case, pad)], codes=(0,))
                spent, whole, code = Path(timing).read_text().split()
                assert code in ("0", "1", "None"), f"{name}: exit {code}"
                shares[name].append((float(spent), float(whole)))
    print(f"machine: {machine()}")
    print(f"runs: {args.runs} each (median), fresh processes, the cases in turns")
    print(f"{'case':<50} {'wall s':>7} {'mask ranks s':>13} {'share':>6}")
    rows = {}
    for name in CASES:
        spent = statistics.median(s for s, _ in shares[name])
        share = statistics.median(s / w for s, w in shares[name])
        rows[name] = {"wall_s": statistics.median(walls[name]), "mask_ranks_s": spent, "share": share}
        print(f"{name:<50} {rows[name]['wall_s']:>7.2f} {spent:>13.2f} {share:>6.1%}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
