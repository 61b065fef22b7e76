"""`attnscope bench`: time the traced path against PyTorch's fused attention on the same inputs.

A race is set up first (inputs, contenders, the FLOPs of one call from a traced run of one batch element,
the memory estimate), so the CLI can say how long it will take before the long part runs. Then each contender runs
`warmup` times and `runs` times; the median is reported. Peak memory is what one call allocates beyond its
inputs, seen allocation by allocation: CUDA's allocator counters on a GPU, PyTorch's profiler
(`profile_memory=True`) on a CPU. No terminal code here: progress goes through a callback.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from attnscope import cost, masks
from attnscope.attention import sdpa
from attnscope.check import reference_mha
from attnscope.errors import UsageError
from attnscope.multihead import MultiHeadAttention

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
class Backend:
    name: str
    eligible: bool
    why_not: str = ""


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
    estimate = cost.sdpa_bytes(batch, nq, nk, dk, dv, itemsize=Q.element_size(), masked=mask is not None)
    return Race("sdpa", params, flops, _bytes(Q, K, V, mask), estimate, dev, dt, candidates,
                backends=lambda: cuda_backends(Q, K, V, mask) if dev.type == "cuda" else [])


def mha_race(batch: int, nq: int, nk: int, d_feat: int, heads: int, *, bias: bool, causal: str | None,
             device: str, dtype: str, kv_heads: int | None = None) -> Race:
    """Three contenders for the whole layer. With fewer K/V heads (GQA), nn.MultiheadAttention cannot hold the
    module, and the third contender is the same layer with K and V expanded to every head before
    F.scaled_dot_product_attention (transformers' repeat_kv), against record=False's enable_gqa=True."""
    dev, dt = resolve(device, dtype)
    torch.manual_seed(0)
    n_kv = heads if kv_heads is None else kv_heads
    traced = MultiHeadAttention(d_feat, heads, bias=bias, device=dev, dtype=dt, n_kv_head=n_kv).eval()
    fast = MultiHeadAttention(d_feat, heads, bias=bias, record=False, device=dev, dtype=dt, n_kv_head=n_kv).eval()
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
    estimate = cost.mha_bytes(batch, nq, nk, d_feat, heads, itemsize=Q.element_size(), bias=bias, cross=nk != nq,
                              masked=mask is not None, n_kv_head=n_kv)

    def backends() -> list[Backend]:
        if dev.type != "cuda":
            return []
        with torch.no_grad():
            steps = traced(Q, KV, KV, mask)
        return cuda_backends(steps["Q_split"], steps["K_split"], steps["V_split"], mask, enable_gqa=n_kv != heads)

    return Race("mha", params, flops, _bytes(Q, KV, mask) + weights, estimate, dev, dt, candidates, backends)


def _expanded_first(module: MultiHeadAttention, Q: torch.Tensor, KV: torch.Tensor,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """The layer as transformers' eager LLaMA writes it: each K/V head repeated for its group, then attention."""
    from attnscope.attention import merge_heads, split_heads

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
                times.append(_timed(fn, race.device))
                tick(name)
            median = statistics.median(times)
            rows.append(Contender(name, median * 1e3, race.flops / median / 1e9, peak_memory(fn, race.device), diff))
    params = {**race.params, "runs": runs, "warmup": warmup}
    return BenchResult(race.command, params, race.flops, rows, race.backends(), memory_method(race.device),
                       race.inputs_bytes, race.estimate_bytes)


def bench_sdpa(batch: int, nq: int, nk: int, dk: int, dv: int, *, causal: str | None, device: str, dtype: str,
               runs: int, warmup: int, tick: Tick = lambda _: None) -> BenchResult:
    return run(sdpa_race(batch, nq, nk, dk, dv, causal=causal, device=device, dtype=dtype), runs, warmup, tick)


def bench_mha(batch: int, nq: int, nk: int, d_feat: int, heads: int, *, bias: bool, causal: str | None,
              device: str, dtype: str, runs: int, warmup: int, tick: Tick = lambda _: None,
              kv_heads: int | None = None) -> BenchResult:
    race = mha_race(batch, nq, nk, d_feat, heads, bias=bias, causal=causal, device=device, dtype=dtype,
                    kv_heads=kv_heads)
    return run(race, runs, warmup, tick)


def _timed(fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _bytes(*tensors: torch.Tensor | None) -> int:
    unique = {id(t): t for t in tensors if t is not None}
    return sum(t.numel() * t.element_size() for t in unique.values())


# --- how long it will take ------------------------------------------------------------------------


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 512) -> float:
    """FLOP/s of an `[n, n] @ [n, n]` matmul here, the best of three: what the machine can do at most."""
    A = torch.randn(n, n, device=device).to(dtype)
    A @ A  # noqa: B018 - warm-up: lazy initialisation, caches
    best = min(_timed(lambda: A @ A, device) for _ in range(3))
    return 2 * n**3 / max(best, 1e-9)


def seconds_estimate(race: Race, runs: int, warmup: int) -> tuple[float, int, float]:
    """(seconds, calls, FLOP/s): every call's FLOPs at the measured matmul rate. Attention runs slower than a
    matmul (the softmax is memory-bound), so the real bench takes this long or longer."""
    calls = len(race.candidates) * (runs + warmup + 2)  # +2: the call checked against the traced output, memory
    rate = matmul_rate(race.device, race.dtype)
    return race.flops * calls / rate, calls, rate


# --- memory ---------------------------------------------------------------------------------------


def memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated during one call, beyond its inputs"
    return "PyTorch's profiler (profile_memory=True): the most one call holds at once, beyond its inputs"


def peak_memory(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Bytes one call allocates at its peak beyond what was already allocated (its inputs and weights)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        del out
        return torch.cuda.max_memory_allocated(device) - before
    from torch.autograd import profiler

    with _quiet_stderr(), profiler.profile(profile_memory=True) as prof:
        out = fn()
    del out
    try:  # every allocation (+bytes) and free (-bytes), in order; the peak is the highest running sum
        events = [(_start(e), e.nbytes()) for e in prof.kineto_results.events() if e.name() == "[memory]"]
    except AttributeError:  # a torch whose profiler reports no allocations
        return None
    held = peak = 0
    for _, nbytes in sorted(events):
        held += nbytes
        peak = max(peak, held)
    return peak


def _start(event: Any) -> int:
    return event.start_ns() if hasattr(event, "start_ns") else 1000 * event.start_us()


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Some torch builds log every profiler start and stop on the process's stderr: not ours to show."""
    try:
        sys.stderr.flush()
        saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError):
        yield
        return
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# --- which fused kernels CUDA would use -------------------------------------------------------------------


def cuda_backends(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None,
                  enable_gqa: bool = False) -> list[Backend]:
    """Ask PyTorch's own eligibility checks (debug=True makes them say why not, as warnings)."""
    from torch.backends import cuda

    q, k, v = (t if t.dim() == 4 else t.unsqueeze(1) for t in (Q, K, V))  # the checks want [n_batch, n_head, n, d]
    params = cuda.SDPAParams(q, k, v, mask, 0.0, False, enable_gqa)
    checks = [
        ("flash", cuda.flash_sdp_enabled, cuda.can_use_flash_attention),
        ("memory-efficient", cuda.mem_efficient_sdp_enabled, cuda.can_use_efficient_attention),
        ("cuDNN", cuda.cudnn_sdp_enabled, getattr(cuda, "can_use_cudnn_attention", None)),
    ]
    backends = []
    for name, enabled, can_use in checks:
        if can_use is None:
            backends.append(Backend(name, False, "this torch has no eligibility check for it"))
            continue
        if not enabled():
            backends.append(Backend(name, False, f"disabled in torch.backends.cuda (enable_{name}_sdp)"))
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok = bool(can_use(params, True))
        reasons = "; ".join(" ".join(str(w.message).split())[:160] for w in caught)
        backends.append(Backend(name, ok, "" if ok else reasons or "not eligible"))
    backends.append(Backend("math", cuda.math_sdp_enabled(), "" if cuda.math_sdp_enabled() else "disabled"))
    return backends
