"""What refusing a hostile GGUF file costs (issue 43, item 3; docs/performance.md): peak RSS and CPU seconds of
`attnscope anatomy FILE` on files of about `--mib` MiB whose header is one huge thing, each ending in a refusal.

    python benchmarks/bench_gguf_hostile.py [--mib 200] [--before DIR]

The files (written here, in a temporary folder): a metadata array of uint8 whose count fills the file, an array
of empty strings that fills it (8 bytes each), arrays of empty arrays that fill it (12 bytes each), arrays of
262,144 empty strings one after another (the most walking a header may do), a metadata count of a key for every
14 bytes, and a tensor table of as many tensors as the file holds. None of them names an
architecture, so every run ends in the same refusal once the header is read (or earlier, where a count is
refused). One fresh process per file and tree: wall seconds, CPU seconds (user + system, from wait4) and the
peak resident set (`ru_maxrss`), with the exit status and the first words of the message.

`--before DIR` runs the same on another attnscope source tree (on PYTHONPATH), e.g. the tree before the change:
`git archive 5fd1a43^ attnscope | tar -x -C DIR`.
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, machine  # noqa: E402

U8, STRING, ARRAY = 0, 8, 9


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def _head(kv_count: int, tensor_count: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensor_count, kv_count)


def write_files(folder: Path, size: int) -> dict[str, Path]:
    """The hostile files, each about `size` bytes, written in 1 MiB pieces (this process stays small)."""
    files: dict[str, tuple[bytes, bytes, int]] = {}  # name -> (header, one repeated item, how many)
    start = _head(1) + _key("junk") + struct.pack("<I", ARRAY)
    files["uint8 array filling the file"] = (start + struct.pack("<IQ", U8, size), b"\0", size)
    files["string array filling the file"] = (start + struct.pack("<IQ", STRING, size // 8), b"\0" * 8, size // 8)
    files["arrays of arrays filling the file"] = (start + struct.pack("<IQ", ARRAY, size // 12),
                                                  struct.pack("<IQ", U8, 0), size // 12)
    per = 1 << 18  # arrays of 262,144 empty strings, one after another: the walk goes on to its bound
    one = _key("s") + struct.pack("<IIQ", ARRAY, STRING, per) + b"\0" * 8 * per
    files["string arrays of 262,144 each, filling it"] = (_head(size // len(one)), one, size // len(one))
    n_keys = size // 14
    files["a key count of the file's size"] = (_head(n_keys), _key("k") + struct.pack("<IB", U8, 1), n_keys)
    n_tensors = size // 33
    files["a tensor count of the file's size"] = (_head(0, n_tensors), _key("t") + struct.pack("<I", 1) +
                                                  struct.pack("<QIQ", 1, 0, 0), n_tensors)
    written = {}
    for i, (name, (header, item, count)) in enumerate(files.items()):
        path = folder / f"hostile{i}.gguf"
        with open(path, "wb") as handle:
            handle.write(header)
            piece = item * max(1, (1 << 20) // len(item))
            per = len(piece) // len(item)
            for _ in range(count // per):
                handle.write(piece)
            handle.write(item * (count % per))
        written[name] = path
    return written


def run(argv: list[str], env: dict[str, str]) -> tuple[float, float, float, int, str]:
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    said = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    words = " ".join(said.split())
    return (wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status),
            words[:110])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=200)
    parser.add_argument("--before", type=Path, help="another attnscope source tree to run the same commands on")
    args = parser.parse_args()
    trees = {"now": None, **({"before": args.before.resolve()} if args.before else {})}
    with tempfile.TemporaryDirectory() as tmp:
        files = write_files(Path(tmp), args.mib << 20)
        print(f"machine: {machine()}; files of {args.mib} MiB; `attnscope anatomy FILE`, one fresh process each\n")
        print("| file | tree | exit | wall (s) | CPU (s) | peak RSS (MiB) | message |")
        print("|---|---|---|---|---|---|---|")
        for name, path in files.items():
            for tree, where in trees.items():
                env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "400",
                       **({"PYTHONPATH": str(where)} if where else {})}
                wall, cpu, peak, code, said = run([PYTHON, "-P", "-c", "from attnscope.cli import run; run()",
                                                   "anatomy", str(path)], env)
                said = said.replace(str(path), "FILE").replace("|", "/")
                print(f"| {name} | {tree} | {code} | {wall:.2f} | {cpu:.2f} | {peak:.0f} | {said} |", flush=True)


if __name__ == "__main__":
    main()
