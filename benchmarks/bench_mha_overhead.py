"""What recording costs: the traced MultiHeadAttention against the same math written plainly, as the
tutorials write it (Linear, view, permute, matmul, softmax, no record), and the record=False fast path
against torch.nn.MultiheadAttention. All with the same weights, in one process, in eval mode under
torch.no_grad(), contenders interleaved round by round; medians of many calls.

Targets: traced <= 1.1x plain; record=False <= 1.1x nn.MultiheadAttention (and the same result).

    python benchmarks/bench_mha_overhead.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _measure import machine  # noqa: E402

from attnscope import MultiHeadAttention  # noqa: E402
from attnscope.check.comparison import reference_mha  # noqa: E402


class TutorialMHA(nn.Module):
    """The seed tutorial's multi-head attention, with no recording: the baseline for the traced path."""

    def __init__(self, source: MultiHeadAttention) -> None:
        super().__init__()
        self.n_head, self.d_head, self.d_feat = source.n_head, source.d_head, source.d_feat
        self.W_q, self.W_k, self.W_v, self.W_o = source.W_q, source.W_k, source.W_v, source.W_o

    def forward(self, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        n_batch = Q.size(0)
        Q_feat, K_feat, V_feat = self.W_q(Q), self.W_k(K), self.W_v(V)
        Q_split = Q_feat.view(n_batch, -1, self.n_head, self.d_head).permute(0, 2, 1, 3)
        K_split = K_feat.view(n_batch, -1, self.n_head, self.d_head).permute(0, 2, 1, 3)
        V_split = V_feat.view(n_batch, -1, self.n_head, self.d_head).permute(0, 2, 1, 3)
        scores = Q_split @ K_split.transpose(-2, -1) / math.sqrt(self.d_head)
        attention = torch.softmax(scores, dim=-1)
        x_raw = attention @ V_split
        x_rsh1 = x_raw.permute(0, 2, 1, 3).contiguous()
        x_rsh2 = x_rsh1.view(n_batch, -1, self.d_feat)
        return self.W_o(x_rsh2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--d-feat", type=int, default=200)
    parser.add_argument("--heads", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    traced = MultiHeadAttention(args.d_feat, args.heads).eval()
    fast = MultiHeadAttention(args.d_feat, args.heads, record=False).eval()
    fast.load_state_dict(traced.state_dict())
    plain = TutorialMHA(traced).eval()
    torch_mha = reference_mha(traced)
    Q = torch.randn(args.batch, args.n, args.d_feat)
    contenders = {
        "tutorial math, plain (no record)": lambda: plain(Q, Q, Q),
        "attnscope MultiHeadAttention (traced)": lambda: traced(Q)["x"],
        "torch.nn.MultiheadAttention": lambda: torch_mha(Q, Q, Q, need_weights=False)[0],
        "attnscope MultiHeadAttention(record=False)": lambda: fast(Q)["x"],
    }
    with torch.no_grad():
        outputs = {name: fn() for name, fn in contenders.items()}
        for _ in range(10):  # warm-up: thread pools, allocator, lazy initialisation
            for fn in contenders.values():
                fn()
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.rounds):
            for name, fn in contenders.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    reference = outputs["torch.nn.MultiheadAttention"]
    print(f"machine: {machine()}; torch threads {torch.get_num_threads()}")
    print(f"n_batch={args.batch} n={args.n} d_feat={args.d_feat} n_head={args.heads}, float32, eval, no_grad; "
          f"median of {args.rounds} interleaved rounds after 10 warm-up\n")
    print("| contender | median ms | ratio | max abs diff vs nn.MultiheadAttention |")
    print("|---|---|---|---|")
    base = {"attnscope MultiHeadAttention (traced)": "tutorial math, plain (no record)",
            "attnscope MultiHeadAttention(record=False)": "torch.nn.MultiheadAttention"}
    for name, ms in medians.items():
        ratio = f"{ms / medians[base[name]]:.2f}x of {base[name]}" if name in base else "(baseline)"
        diff = (outputs[name] - reference).abs().max().item()
        print(f"| {name} | {ms:.3f} | {ratio} | {diff:.1e} |")
    print("\ntargets: traced <= 1.10x of plain; record=False <= 1.10x of torch.nn.MultiheadAttention")


if __name__ == "__main__":
    main()
