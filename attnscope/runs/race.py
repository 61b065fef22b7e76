"""The races `attnscope bench` runs: the traced path against PyTorch's fused attention on the same inputs.

A race is set up first (inputs, contenders, the FLOPs of one call from a traced run of one batch element,
the memory estimate), so the CLI can say how long it will take before the long part runs. Then each contender runs
`warmup` times and `runs` times; the median is reported, with the peak memory of one call beyond its inputs
(measure.py). No terminal code here: progress goes through a callback.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from attnscope import cost, masks
from attnscope.attention.dot_product import sdpa
from attnscope.attention.multihead import MultiHeadAttention
from attnscope.check.comparison import reference_mha
from attnscope.errors import UsageError
from attnscope.runs import measure
from attnscope.runs.measure import Backend
from attnscope.spec import AttentionSpec

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}

Tick = Callable[[str], None]


@dataclass
class Contender:
    name: str
    median_ms: float
    gflops_per_s: float
    peak_bytes: int | None  # allocated by one call at its peak, beyond the inputs
    max_abs_diff: float  # against the traced path's output: all rows compute the same thing


@dataclass
class Race:
    """Everything a bench needs before the first timed call."""

    command: str
    params: dict[str, Any]
    flops: int  # one call, counted on a traced run of one batch element
    inputs_bytes: int  # inputs, weights and mask: held before any call
    estimate_bytes: int  # attnscope's estimate of the traced run (cost.sdpa_bytes / cost.mha_bytes)
    device: torch.device
    dtype: torch.dtype
    candidates: dict[str, Callable[[], torch.Tensor]]
    backends: Callable[[], list[Backend]] = lambda: []


@dataclass
class BenchResult:
    command: str
    params: dict[str, Any]
    flops: int
    contenders: list[Contender]
    backends: list[Backend] = field(default_factory=list)
    memory_method: str = ""
    inputs_bytes: int = 0
    estimate_bytes: int = 0


def resolve(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device {device}: use cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available to this torch (torch.cuda.is_available() "
                         "is False); use --device cpu")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    return torch.device(device), DTYPES[dtype]


def sdpa_race(batch: int, nq: int, nk: int, dk: int, dv: int, *, causal: str | None, device: str,
              dtype: str) -> Race:
    dev, dt = resolve(device, dtype)
    generator = torch.Generator(device=dev).manual_seed(0)
    Q, K, V = (torch.randn(batch, n, d, device=dev, dtype=dt, generator=generator)
               for n, d in ((nq, dk), (nk, dk), (nk, dv)))
    mask = masks.causal_mask(nq, nk, causal, dev) if causal else None  # type: ignore[arg-type]
    flops = batch * sdpa(Q[:1], K[:1], V[:1], mask).total_flops  # every step's FLOPs grow with the batch
    params = {"batch": batch, "batch_shape": [batch], "nq": nq, "nk": nk, "dk": dk, "dv": dv, "causal": causal,
              "device": device, "dtype": dtype}
    candidates: dict[str, Callable[[], torch.Tensor]] = {
        "attnscope sdpa (traced)": lambda: sdpa(Q, K, V, mask)["out"],
        "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(Q, K, V, attn_mask=mask),
    }
    estimate = cost.sdpa_bytes(batch, nq, nk, dk, dv, AttentionSpec(causal=causal), itemsize=Q.element_size())
    return Race("sdpa", params, flops, _bytes(Q, K, V, mask), estimate, dev, dt, candidates,
                backends=lambda: measure.cuda_backends(Q, K, V, mask) if dev.type == "cuda" else [])


def mha_race(batch: int, nq: int, nk: int, d_feat: int, heads: int, *, bias: bool, causal: str | None,
             device: str, dtype: str, kv_heads: int | None = None) -> Race:
    """Three contenders for the whole layer. With fewer K/V heads (GQA), nn.MultiheadAttention cannot hold the
    module, and the third contender is the same layer with K and V expanded to every head before
    F.scaled_dot_product_attention (transformers' repeat_kv), against record=False's enable_gqa=True."""
    dev, dt = resolve(device, dtype)
    torch.manual_seed(0)
    n_kv = heads if kv_heads is None else kv_heads
    traced = MultiHeadAttention(d_feat, heads, bias=bias, device=dev, dtype=dt, n_kv_head=n_kv).eval()
    fast = MultiHeadAttention(d_feat, heads, bias=bias, record=False, device=dev, dtype=dt, n_kv_head=n_kv,
                              fused=True).eval()  # PyTorch's fused kernel: the fast path raced
    fast.load_state_dict(traced.state_dict())
    generator = torch.Generator(device=dev).manual_seed(0)
    Q = torch.randn(batch, nq, d_feat, device=dev, dtype=dt, generator=generator)
    KV = Q if nk == nq else torch.randn(batch, nk, d_feat, device=dev, dtype=dt, generator=generator)
    mask = masks.causal_mask(nq, nk, causal, dev) if causal else None  # type: ignore[arg-type]
    with torch.no_grad():  # every step's FLOPs grow with the batch: one element says it all
        flops = batch * traced(Q[:1], KV[:1], KV[:1], mask).total_flops
    params = {"batch": batch, "batch_shape": [batch], "nq": nq, "nk": nk, "d_feat": d_feat, "heads": heads,
              "kv_heads": n_kv, "bias": bias, "causal": causal, "device": device, "dtype": dtype}
    candidates: dict[str, Callable[[], torch.Tensor]] = {
        "attnscope MultiHeadAttention (traced)": lambda: traced(Q, KV, KV, mask)["x"],
    }
    if n_kv == heads:
        torch_mha = reference_mha(traced)
        torch_mask = None if mask is None else ~mask  # nn.MultiheadAttention: True = masked out
        candidates["attnscope MultiHeadAttention(record=False)"] = lambda: fast(Q, KV, KV, mask)["x"]
        candidates["torch.nn.MultiheadAttention"] = lambda: torch_mha(Q, KV, KV, attn_mask=torch_mask,
                                                                      need_weights=False)[0]
    else:
        candidates["record=False: F.scaled_dot_product_attention(enable_gqa=True)"] = lambda: fast(Q, KV, KV, mask)["x"]
        candidates["K/V expanded first (repeat_kv), then F.scaled_dot_product_attention"] = \
            lambda: _expanded_first(fast, Q, KV, mask)
    weights = sum(p.numel() * p.element_size() for p in traced.parameters())
    estimate = cost.mha_bytes(batch, nq, nk, d_feat, heads, AttentionSpec(causal=causal, n_kv_head=n_kv),
                              itemsize=Q.element_size(), bias=bias, cross=nk != nq)

    def backends() -> list[Backend]:
        if dev.type != "cuda":
            return []
        with torch.no_grad():
            steps = traced(Q, KV, KV, mask)
        return measure.cuda_backends(steps["Q_split"], steps["K_split"], steps["V_split"], mask,
                                     enable_gqa=n_kv != heads)

    return Race("mha", params, flops, _bytes(Q, KV, mask) + weights, estimate, dev, dt, candidates, backends)


def _expanded_first(module: MultiHeadAttention, Q: torch.Tensor, KV: torch.Tensor,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """The layer as transformers' eager LLaMA writes it: each K/V head repeated for its group, then attention."""
    from attnscope.attention.stages import merge_heads, split_heads

    q = split_heads(module.W_q(Q), module.n_head)  # [n_batch, n_head, n_Q, d_head]
    k = split_heads(module.W_k(KV), module.n_kv_head).repeat_interleave(module.n_group, dim=1)  # -> n_head heads
    v = split_heads(module.W_v(KV), module.n_kv_head).repeat_interleave(module.n_group, dim=1)
    x_raw = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [n_batch, n_head, n_Q, d_head]
    return module.W_o(merge_heads(x_raw))  # [n_batch, n_Q, d_feat]


def run(race: Race, runs: int, warmup: int, tick: Tick = lambda _: None) -> BenchResult:
    """Time every contender, measure its peak memory and its difference from the traced path (the first)."""
    rows: list[Contender] = []
    expected: torch.Tensor | None = None
    with torch.no_grad():
        for name, fn in race.candidates.items():
            out = fn()
            if expected is None:
                expected = out
            diff = float((out.double() - expected.double()).abs().max()) if out.numel() else 0.0
            del out
            for _ in range(warmup):
                fn()
                tick(name)
            times = []
            for _ in range(runs):
                times.append(measure.timed(fn, race.device))
                tick(name)
            median = statistics.median(times)
            peak = measure.peak_memory(fn, race.device)
            rows.append(Contender(name, median * 1e3, race.flops / median / 1e9, peak, diff))
    params = {**race.params, "runs": runs, "warmup": warmup}
    return BenchResult(race.command, params, race.flops, rows, race.backends(), measure.memory_method(race.device),
                       race.inputs_bytes, race.estimate_bytes)


def _bytes(*tensors: torch.Tensor | None) -> int:
    unique = {id(t): t for t in tensors if t is not None}
    return sum(t.numel() * t.element_size() for t in unique.values())


def seconds_estimate(race: Race, runs: int, warmup: int) -> tuple[float, int, float]:
    """(seconds, calls, FLOP/s): every call's FLOPs at the measured matmul rate. Attention runs slower than a
    matmul (the softmax is memory-bound), so the real bench takes this long or longer."""
    calls = len(race.candidates) * (runs + warmup + 2)  # +2: the call checked against the traced output, memory
    rate = measure.matmul_rate(race.device, race.dtype)
    return race.flops * calls / rate, calls, rate
