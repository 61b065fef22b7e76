"""`attnscope bench`: time the traced path against PyTorch's fused attention on the same inputs.

Each contender runs `warmup` times, then `runs` times; the median is reported. Peak memory is measured
on CUDA with the allocator's own counters, and on Linux CPUs as the growth of the process's resident
set (its high-water mark is reset before each measured call). No terminal code here: progress is
reported through a callback, which the CLI turns into a progress bar.
"""

from __future__ import annotations

import ctypes
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from attnscope import masks
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
    peak_bytes: int | None
    max_abs_diff: float  # against the traced path's output: all rows compute the same thing


@dataclass
class Backend:
    name: str
    eligible: bool
    why_not: str = ""


@dataclass
class BenchResult:
    command: str
    params: dict[str, Any]
    flops: int
    contenders: list[Contender]
    backends: list[Backend] = field(default_factory=list)
    memory_method: str = ""


def resolve(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device {device}: use cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available to this torch (torch.cuda.is_available() "
                         "is False); use --device cpu")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    return torch.device(device), DTYPES[dtype]


def bench_sdpa(batch: int, nq: int, nk: int, dk: int, dv: int, *, causal: str | None, device: str, dtype: str,
               runs: int, warmup: int, tick: Tick = lambda _: None) -> BenchResult:
    dev, dt = resolve(device, dtype)
    generator = torch.Generator(device=dev).manual_seed(0)
    Q, K, V = (torch.randn(batch, n, d, device=dev, dtype=dt, generator=generator)
               for n, d in ((nq, dk), (nk, dk), (nk, dv)))
    mask = masks.causal_mask(nq, nk, causal, dev) if causal else None  # type: ignore[arg-type]
    reference = sdpa(Q, K, V, mask)
    flops = reference.total_flops
    candidates: dict[str, Callable[[], torch.Tensor]] = {
        "attnscope sdpa (traced)": lambda: sdpa(Q, K, V, mask)["out"],
        "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(Q, K, V, attn_mask=mask),
    }
    params = {"batch": batch, "nq": nq, "nk": nk, "dk": dk, "dv": dv, "causal": causal, "device": device,
              "dtype": dtype, "runs": runs, "warmup": warmup}
    result = BenchResult("sdpa", params, flops, _race(candidates, reference["out"], flops, runs, warmup, dev, tick),
                         memory_method=_memory_method(dev))
    if dev.type == "cuda":
        result.backends = cuda_backends(Q, K, V, mask)
    return result


def bench_mha(batch: int, nq: int, nk: int, d_feat: int, heads: int, *, bias: bool, causal: str | None,
              device: str, dtype: str, runs: int, warmup: int, tick: Tick = lambda _: None) -> BenchResult:
    dev, dt = resolve(device, dtype)
    torch.manual_seed(0)
    traced = MultiHeadAttention(d_feat, heads, bias=bias, device=dev, dtype=dt).eval()
    fast = MultiHeadAttention(d_feat, heads, bias=bias, record=False, device=dev, dtype=dt).eval()
    fast.load_state_dict(traced.state_dict())
    torch_mha = reference_mha(traced)
    generator = torch.Generator(device=dev).manual_seed(0)
    Q = torch.randn(batch, nq, d_feat, device=dev, dtype=dt, generator=generator)
    KV = Q if nk == nq else torch.randn(batch, nk, d_feat, device=dev, dtype=dt, generator=generator)
    mask = masks.causal_mask(nq, nk, causal, dev) if causal else None  # type: ignore[arg-type]
    torch_mask = None if mask is None else ~mask  # nn.MultiheadAttention: True = masked out
    with torch.no_grad():
        reference = traced(Q, KV, KV, mask)
    flops = reference.total_flops
    candidates: dict[str, Callable[[], torch.Tensor]] = {
        "attnscope MultiHeadAttention (traced)": lambda: traced(Q, KV, KV, mask)["x"],
        "attnscope MultiHeadAttention(record=False)": lambda: fast(Q, KV, KV, mask)["x"],
        "torch.nn.MultiheadAttention": lambda: torch_mha(Q, KV, KV, attn_mask=torch_mask, need_weights=False)[0],
    }
    params = {"batch": batch, "nq": nq, "nk": nk, "d_feat": d_feat, "heads": heads, "bias": bias, "causal": causal,
              "device": device, "dtype": dtype, "runs": runs, "warmup": warmup}
    result = BenchResult("mha", params, flops, _race(candidates, reference["x"], flops, runs, warmup, dev, tick),
                         memory_method=_memory_method(dev))
    if dev.type == "cuda":
        result.backends = cuda_backends(reference["Q_split"], reference["K_split"], reference["V_split"], mask)
    return result


def _race(candidates: dict[str, Callable[[], torch.Tensor]], expected: torch.Tensor, flops: int, runs: int,
          warmup: int, device: torch.device, tick: Tick) -> list[Contender]:
    rows = []
    with torch.no_grad():
        for name, fn in candidates.items():
            out = fn()
            diff = float((out.double() - expected.double()).abs().max()) if out.numel() else 0.0
            del out
            for _ in range(warmup):
                fn()
                tick(name)
            times = []
            for _ in range(runs):
                times.append(_timed(fn, device))
                tick(name)
            median = statistics.median(times)
            rows.append(Contender(name, median * 1e3, flops / median / 1e9, peak_memory(fn, device), diff))
    return rows


def _timed(fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


# --- memory ---------------------------------------------------------------------------------------


def _memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated, beyond the inputs"
    if _linux_hwm_resettable():
        return "growth of the process's peak resident set during one call, beyond the inputs"
    return "not measured on this platform"


def peak_memory(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Bytes one call needs beyond what was already allocated (its inputs and weights)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        del out
        return torch.cuda.max_memory_allocated(device) - before
    if not _linux_hwm_resettable():
        return None
    _pin_malloc_threshold()
    before = _reset_hwm()
    out = fn()
    peak = _status_kib("VmHWM") * 1024
    del out
    return max(0, peak - before)


_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field_name: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise OSError(field_name)


def _linux_hwm_resettable() -> bool:
    try:
        _reset_hwm()
        return True
    except OSError:
        return False


def _reset_hwm() -> int:
    """Reset the peak resident set to the current one ("5" > clear_refs, Linux >= 4.0); return it in bytes."""
    _CLEAR_REFS.write_text("5")
    return _status_kib("VmRSS") * 1024


_pinned = False


def _pin_malloc_threshold() -> None:
    """glibc raises its mmap threshold after large frees and then keeps freed blocks in the heap, where a
    later call reuses them without growing the resident set; a fixed threshold returns them at once."""
    global _pinned
    if _pinned:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass
    _pinned = True


# --- which fused kernels CUDA would use -------------------------------------------------------------------


def cuda_backends(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None) -> list[Backend]:
    """Ask PyTorch's own eligibility checks (debug=True makes them say why not, as warnings)."""
    from torch.backends import cuda

    q, k, v = (t if t.dim() == 4 else t.unsqueeze(1) for t in (Q, K, V))  # the checks want [n_batch, n_head, n, d]
    params = cuda.SDPAParams(q, k, v, mask, 0.0, False, False)
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
