"""Grouped-query attention two ways: `F.scaled_dot_product_attention(enable_gqa=True)` against K and V
expanded to every query head first (transformers' `repeat_kv`, then the same call), as
`attnscope bench mha --kv-heads N` times them. PyTorch's GQA path may fall back to its math kernel, so
which is faster depends on the build and the sizes: this script says which, here.

Each case runs `attnscope bench mha ... --json` in a fresh process, ROUNDS times; a round's figure per
contender is bench's own median of --runs calls, and the table gives the median over the rounds, with
the ratio enable_gqa / expanded taken inside each round (so a slow moment hits both alike).

    python benchmarks/bench_gqa.py [--rounds 5] [--runs 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import machine  # noqa: E402

ATTNSCOPE = str(Path(sys.executable).with_name("attnscope"))

CASES = [  # (label, bench mha options)
    ("8 x 256, d_feat 512, 8 heads / 2 KV", ["--batch", "8", "--nq", "256", "--d-feat", "512", "--heads", "8",
                                             "--kv-heads", "2", "--causal"]),
    ("8 x 256, d_feat 512, 8 heads / 1 KV (MQA)", ["--batch", "8", "--nq", "256", "--d-feat", "512", "--heads", "8",
                                                   "--kv-heads", "1", "--causal"]),
    ("1 x 2048, d_feat 2048, 16 heads / 4 KV", ["--batch", "1", "--nq", "2048", "--d-feat", "2048", "--heads", "16",
                                                "--kv-heads", "4", "--causal"]),
    ("1 x 1 decode, 4096 keys, d_feat 2048, 16 heads / 4 KV", ["--batch", "1", "--nq", "1", "--nk", "4096",
                                                               "--d-feat", "2048", "--heads", "16", "--kv-heads", "4"]),
]
GQA, EXPANDED = "enable_gqa=True", "expanded first"


def one_round(options: list[str], runs: int) -> dict[str, dict]:
    out = subprocess.run([ATTNSCOPE, "bench", "mha", *options, "--runs", str(runs), "--json"],
                         check=True, capture_output=True, text=True).stdout
    found = {}
    for contender in json.loads(out)["contenders"]:
        if "enable_gqa=True" in contender["name"]:
            found[GQA] = contender
        elif "expanded first" in contender["name"]:
            found[EXPANDED] = contender
    if len(found) != 2:
        raise SystemExit(f"bench mha {' '.join(options)}: expected both GQA contenders, got {out[:400]}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    print(f"machine: {machine()}\n")
    print("| case | enable_gqa=True (ms) | expanded first (ms) | enable_gqa / expanded | peak memory, "
          "enable_gqa / expanded (MiB) | faster here |")
    print("|---|---|---|---|---|---|")
    for label, options in CASES:
        rounds = [one_round(options, args.runs) for _ in range(args.rounds)]
        gqa = statistics.median(r[GQA]["median_ms"] for r in rounds)
        expanded = statistics.median(r[EXPANDED]["median_ms"] for r in rounds)
        ratio = statistics.median(r[GQA]["median_ms"] / r[EXPANDED]["median_ms"] for r in rounds)
        mem = f"{rounds[0][GQA]['peak_bytes'] / 2**20:.1f} / {rounds[0][EXPANDED]['peak_bytes'] / 2**20:.1f}"
        shown = round(ratio, 2)
        faster = "enable_gqa" if shown < 0.97 else "expanded" if shown > 1.03 else "even (within 3%)"
        print(f"| {label} | {gqa:.2f} | {expanded:.2f} | {ratio:.2f}x | {mem} | {faster} |")
    print(f"\n(median over {args.rounds} rounds, each a fresh `attnscope bench mha --runs {args.runs}`, "
          "which takes the median of its runs after 3 warm-up)")


if __name__ == "__main__":
    main()
