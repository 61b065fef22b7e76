"""What the layers before the one shown cost in eager's order (attention/rows.py) against PyTorch's fused kernel.

A model's unrecorded layers compute attention as transformers' eager attention does, a block of query rows at a
time, so that later layers agree with eager `output_attentions` to the last bit (issue 43, item 24: Gemma 4's
unscaled logits carried the fused kernel's rounding to 2e-5 four layers on). This times one attention module
`MultiHeadAttention(record=False)` (projections included) both ways, in turns within one process, and gives each
one's distance from a float64 eager formula.

    python benchmarks/bench_rows.py [--rounds 5]
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

from attnscope.attention.multihead import MultiHeadAttention  # noqa: E402

CASES = [  # (label, d_feat, n_head, n_kv_head, n tokens)
    ("SmolLM2-135M's layer, 512 tokens", 576, 9, 3, 512),
    ("SmolLM2-135M's layer, 2,048 tokens", 576, 9, 3, 2048),
    ("SmolLM2-135M's layer, 4,096 tokens", 576, 9, 3, 4096),
    ("LLaMA 1.1B's layer, 1,024 tokens", 2048, 32, 4, 1024),
]


def float64_eager(module: MultiHeadAttention, X: torch.Tensor) -> torch.Tensor:
    """softmax(Q Kᵀ / sqrt(d) + causal) V in float64, from the module's own weights."""
    n, d = X.shape[1], module.d_head
    W = {k: v.double() for k, v in module.state_dict().items()}
    x = X.double()
    q = (x @ W["W_q.weight"].T + W["W_q.bias"]).view(1, n, module.n_head, d).transpose(1, 2)
    k = (x @ W["W_k.weight"].T + W["W_k.bias"]).view(1, n, module.n_kv_head, d).transpose(1, 2)
    v = (x @ W["W_v.weight"].T + W["W_v.bias"]).view(1, n, module.n_kv_head, d).transpose(1, 2)
    k, v = k.repeat_interleave(module.n_group, 1), v.repeat_interleave(module.n_group, 1)
    scores = (q @ k.transpose(-1, -2)) / d ** 0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    out = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(1, n, -1)
    return out @ W["W_o.weight"].T + W["W_o.bias"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"machine: {machine()}; torch threads {torch.get_num_threads()}")
    print("| layer | eager rows (ms) | fused (ms) | ratio | eager rows vs float64 | fused vs float64 |")
    print("|---|---|---|---|---|---|")
    for label, d_feat, n_head, n_kv, n in CASES:
        torch.manual_seed(0)
        eager = MultiHeadAttention(d_feat, n_head, n_kv_head=n_kv, causal=True, record=False).eval()
        fused = MultiHeadAttention(d_feat, n_head, n_kv_head=n_kv, causal=True, record=False, fused=True).eval()
        fused.load_state_dict(eager.state_dict())
        X = torch.randn(1, n, d_feat)
        times: dict[str, list[float]] = {"eager": [], "fused": []}
        with torch.no_grad():
            outs = {"eager": eager(X)["x"], "fused": fused(X)["x"]}  # warm-up
            for _ in range(args.rounds):
                for name, module in (("eager", eager), ("fused", fused)):
                    start = time.perf_counter()
                    module(X)
                    times[name].append(time.perf_counter() - start)
            want = float64_eager(eager, X)
        ratios = [e / f for e, f in zip(times["eager"], times["fused"], strict=True)]
        diff = {name: float((out.double() - want).abs().max()) for name, out in outs.items()}
        print(f"| {label} | {statistics.median(times['eager']) * 1e3:.0f} | "
              f"{statistics.median(times['fused']) * 1e3:.0f} | {statistics.median(ratios):.2f}x | "
              f"{diff['eager']:.1e} | {diff['fused']:.1e} |")


if __name__ == "__main__":
    main()
