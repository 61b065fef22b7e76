"""A linear layer's M @ V check (attention/linear_attention.py's `_check`: blocks of rows over only the columns each
may weigh) against the product taken whole, `(M @ V - x_raw).abs().max()` in float64, in the same process, in
turns; and M's own computation (`effective_matrix`) for scale. A gated DeltaNet's layer, d_K = d_V = 128.

    python benchmarks/bench_linear_check.py [--runs 5] [--tokens 2048] [--heads 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _measure import machine  # noqa: E402

from attnscope.attention.linear_attention import _check, effective_matrix, recurrence  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n, n_head, d = args.tokens, args.heads, 128
    q = torch.randn(1, n_head, n, d) / d**0.5
    k = torch.nn.functional.normalize(torch.randn(1, n_head, n, d), dim=-1)
    v = torch.randn(1, n_head, n, d)
    g, beta = -torch.rand(1, n_head, n) * 0.1, torch.rand(1, n_head, n)
    x_raw, _ = recurrence(q, k, v, g, beta, torch.zeros(1, n_head, d, d))
    start = time.perf_counter()
    M, _ = effective_matrix(q, k, g, beta, torch.zeros(1, n_head, d, 0, dtype=torch.float64))
    m_seconds = time.perf_counter() - start
    whole, blocked = [], []
    for _ in range(args.runs):
        start = time.perf_counter()
        a = float((M @ v.double() - x_raw.double()).abs().max())
        whole.append(time.perf_counter() - start)
        start = time.perf_counter()
        b = _check(M, v, x_raw)
        blocked.append(time.perf_counter() - start)
    print(f"{machine()}; {args.threads} thread(s); {n:,} tokens, {n_head} heads; median of {args.runs}")
    print(f"M (effective_matrix, once): {m_seconds:.3f} s")
    print(f"check, whole product: {statistics.median(whole):.3f} s; in blocks: {statistics.median(blocked):.3f} s "
          f"({statistics.median(blocked) / statistics.median(whole):.2f}x); figures {a:.3e} and {b:.3e}")


if __name__ == "__main__":
    main()
