"""A linear attention layer's exact matrix M (effective_attention) two ways, in the same process, in turns: the
chunked form attnscope computes (attention/linear_attention.py's `effective_matrix`: the UT transform, a chunk
of tokens at a time) against the recurrence run on the identity token by token, its former way and the tests'
reference (tests/linear_reference.py). Float64, d_K 128, one batch row, 1 and 32 heads, 256, 1,024 and 2,048
tokens; the three kinds of layer: a gated DeltaNet's (Qwen3-Next, Qwen3.5: one decay per head and token), KDA's
(Kimi Linear: one per key channel) and MiniMax's lightning attention (no delta rule: the closed form). Each row
also gives the largest difference between the two Ms relative to M's largest entry (docs/performance.md).
`--memory`: instead, each way once in a fresh process, its peak resident set beyond a process that only builds
the inputs, against M's own size.

    python benchmarks/bench_linear.py [--runs 3] [--tokens 256 1024 2048] [--heads 1 32] [--kinds gdn kda minimax]
        [--chunk 64] [--threads N] [--new-only] [--memory]

`--threads 1` on a machine shared with other work: there torch's default of one thread per core waits at every
small operation for a thread the other processes hold (10 to 100 times slower here for both ways).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from _measure import PYTHON, machine, run_once  # noqa: E402
from linear_reference import effective_matrix_by_recurrence  # noqa: E402

from attnscope.attention.linear_attention import CHUNK, effective_matrix  # noqa: E402

D_K = 128
KINDS = {"gdn": "gated DeltaNet", "kda": "KDA (per channel)", "minimax": "MiniMax lightning"}
# argv: kind, tokens, heads, and "inputs" (the baseline), "chunked" or "recurrence"
ONE_WAY = f"""
import sys
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1] / "tests")!r}]
import torch
from bench_linear import D_K, inputs
from linear_reference import effective_matrix_by_recurrence
from attnscope.attention.linear_attention import effective_matrix
kind, n, n_head, way = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
q, k, g, beta = inputs(kind, n_head, n)
empty = torch.zeros(1, n_head, D_K, 0, dtype=torch.float64)
if way != "inputs":
    (effective_matrix if way == "chunked" else effective_matrix_by_recurrence)(q, k, g, beta, empty)
"""


def inputs(kind: str, n_head: int, n: int) -> tuple[torch.Tensor, ...]:
    """q, k as the layers hand them over (l2-normed, q scaled by d_K^-0.5; MiniMax's: SiLU, neither), the
    log-decay g as the layers make it (-exp(A_log) · softplus(a + dt_bias); MiniMax's: -slope_h), beta =
    sigmoid(b) (None for MiniMax)."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, n_head, n, D_K, dtype=torch.float64)
    if kind == "minimax":
        q, k = torch.nn.functional.silu(q) / D_K ** 0.5, torch.nn.functional.silu(k) / D_K ** 0.5
        slopes = 2.0 ** (-8 * (torch.arange(n_head, dtype=torch.float64) + 1) / n_head)
        return q, k, -slopes[None, :, None].expand(1, n_head, n), None
    q = torch.nn.functional.normalize(q, dim=-1) * D_K ** -0.5
    k = torch.nn.functional.normalize(k, dim=-1)
    shape = (1, n_head, n, D_K) if kind == "kda" else (1, n_head, n)
    rate = torch.rand((n_head, 1, D_K) if kind == "kda" else (n_head, 1), dtype=torch.float64)  # exp(A_log)
    g = -rate * torch.nn.functional.softplus(torch.randn(shape, dtype=torch.float64))
    return q, k, g, torch.sigmoid(torch.randn(1, n_head, n, dtype=torch.float64))


def timed(fn, *args, **kwargs) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    M, _ = fn(*args, **kwargs)
    return time.perf_counter() - start, M


def memory(args: argparse.Namespace) -> None:
    print(f"machine: {machine()}; peak RSS of one run in a fresh process, less that of a process that builds the "
          "inputs alone\n")
    print("| layer | tokens | heads | M itself (MiB) | chunked (MiB) | recurrence (MiB) |")
    print("|---|---|---|---|---|---|")
    for kind in args.kinds:
        for n in args.tokens:
            for n_head in args.heads:
                peak = {way: run_once([PYTHON, "-c", ONE_WAY, kind, str(n), str(n_head), way]).peak_mib
                        for way in ("inputs", "chunked", *(() if args.new_only else ("recurrence",)))}
                old = f"{peak['recurrence'] - peak['inputs']:.0f}" if "recurrence" in peak else "-"
                print(f"| {KINDS[kind]} | {n:,} | {n_head} | {n_head * n * n * 8 / 2**20:.0f} | "
                      f"{peak['chunked'] - peak['inputs']:.0f} | {old} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--heads", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    parser.add_argument("--chunk", type=int, default=CHUNK)
    parser.add_argument("--new-only", action="store_true", help="time the chunked form alone (no ratio)")
    parser.add_argument("--memory", action="store_true", help="peak memory of each way, not time")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory:
        return memory(args)
    print(f"machine: {machine()}, torch threads: {torch.get_num_threads()}; float64, d_K {D_K}, chunk {args.chunk}; "
          f"median of {args.runs} runs, the two ways in turns\n")
    print("| layer | tokens | heads | recurrence (s) | chunked (s) | speed-up | largest difference / max abs M |")
    print("|---|---|---|---|---|---|---|")
    for kind in args.kinds:
        for n in args.tokens:
            for n_head in args.heads:
                q, k, g, beta = inputs(kind, n_head, n)
                empty = torch.zeros(1, n_head, D_K, 0, dtype=torch.float64)
                old: list[float] = []
                new: list[float] = []
                difference = 0.0
                for _ in range(args.runs):
                    seconds, M = timed(effective_matrix, q, k, g, beta, empty, chunk=args.chunk)
                    new.append(seconds)
                    if not args.new_only:
                        seconds, reference = timed(effective_matrix_by_recurrence, q, k, g, beta, empty)
                        old.append(seconds)
                        difference = float((M - reference).abs().max() / reference.abs().max())
                    del M
                fast = statistics.median(new)
                slow = f"{statistics.median(old):.3f}" if old else "-"
                ratio = f"{statistics.median(old) / fast:.1f}x" if old else "-"
                shown = f"{difference:.1e}" if old else "-"
                print(f"| {KINDS[kind]} | {n:,} | {n_head} | {slow} | {fast:.3f} | {ratio} | {shown} |", flush=True)


if __name__ == "__main__":
    main()
