"""`--meta` with file inputs reads headers only: a shape-only trace of a 10 GiB `.npy`, and of a 1 MB `.npz`
that inflates to 1 GiB, against a tiny `attnscope sdpa --meta` with random inputs.

Targets: the 10 GiB file answers as fast as the tiny run and in no more memory (both within 10%: what the
run costs is torch's import, not the file). The files are sparse (made by seeking) or compressed zeros, so
the script needs about 1 MB of disk, and writes them in a temporary folder it removes.

    python benchmarks/bench_meta_files.py [--runs 7]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, interleaved_medians, machine  # noqa: E402

BIG = (10, 16384, 16384)  # float32: 10 GiB
BOMB = (1024, 1024, 256)  # float32 zeros: 1 GiB inflated


def npy_header(shape: tuple[int, ...]) -> bytes:
    """The .npy format's version-1.0 header for a C-ordered little-endian float32 array (numpy's format spec)."""
    text = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}"
    pad = 64 - (10 + len(text) + 1) % 64
    body = (text + " " * pad + "\n").encode("latin1")
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body


def write_files(folder: Path) -> None:
    with open(folder / "big.npy", "wb") as handle:  # sparse: the data is a hole, 10 GiB on paper
        handle.write(npy_header(BIG))
        handle.truncate(handle.tell() + 4 * math.prod(BIG))
    chunk = bytes(1 << 24)
    with zipfile.ZipFile(folder / "bomb.npz", "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("q.npy", "w", force_zip64=True) as member:
            member.write(npy_header(BOMB))
            for _ in range(4 * math.prod(BOMB) // len(chunk)):
                member.write(chunk)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    attnscope = shutil.which("attnscope") or f"{Path(PYTHON).parent}/attnscope"
    folder = Path(tempfile.mkdtemp(prefix="attnscope-bench-"))
    try:
        write_files(folder)
        sizes = {name: (folder / name).stat().st_size for name in ("big.npy", "bomb.npz")}
        env = {**os.environ, "NO_COLOR": "1"}
        results = interleaved_medians({
            "attnscope sdpa --meta (tiny, random inputs)": [attnscope, "sdpa", "--meta"],
            "attnscope sdpa --q big.npy --meta (10 GiB .npy)": [attnscope, "sdpa", "--q", str(folder / "big.npy"),
                                                                "--meta"],
            f"attnscope sdpa --q bomb.npz --meta ({sizes['bomb.npz'] / 1e6:.1f} MB .npz, 1 GiB inflated)":
                [attnscope, "sdpa", "--q", str(folder / "bomb.npz"), "--meta"],
        }, runs=args.runs, env=env)
    finally:
        shutil.rmtree(folder)
    base = next(iter(results.values()))
    print(f"machine: {machine()}; median of {args.runs} interleaved runs after 1 warm-up, fresh process each\n")
    print("| command | median wall (s) | median peak RSS (MiB) | wall vs tiny | memory vs tiny |")
    print("|---|---|---|---|---|")
    for name, sample in results.items():
        print(f"| `{name}` | {sample.seconds:.2f} | {sample.peak_mib:.0f} | {sample.seconds / base.seconds:.2f}x | "
              f"{sample.peak_mib / base.peak_mib:.2f}x |")
    print("\ntarget: the 10 GiB file within 1.10x of the tiny run, in wall time and in memory")


if __name__ == "__main__":
    main()
