"""How `attnscope bench` measures: wall time of one call, the machine's matmul rate (to say how long a bench
will take before it starts), the peak memory one call allocates, and which fused kernels CUDA would pick.

Peak memory is seen allocation by allocation: CUDA's allocator counters on a GPU, PyTorch's profiler
(`profile_memory=True`) on a CPU.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Backend:
    name: str
    eligible: bool
    why_not: str = ""


def timed(fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


# --- how long it will take ------------------------------------------------------------------------


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 512) -> float:
    """FLOP/s of an `[n, n] @ [n, n]` matmul here, the best of three: what the machine can do at most."""
    A = torch.randn(n, n, device=device).to(dtype)
    # [n, n] @ [n, n] -> [n, n]
    A @ A  # noqa: B018 - warm-up: lazy initialisation, caches
    best = min(timed(lambda: A @ A, device) for _ in range(3))  # [n, n] @ [n, n] -> [n, n]
    return 2 * n**3 / max(best, 1e-9)


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
            ok, printed = stderr_of(functools.partial(can_use, params, True))
            ok = bool(ok)
        said = [str(w.message) for w in caught] + cpp_warnings(printed)
        reasons = "; ".join(dict.fromkeys(" ".join(m.split())[:160] for m in said))
        backends.append(Backend(name, ok, "" if ok else reasons or "not eligible"))
    backends.append(Backend("math", cuda.math_sdp_enabled(), "" if cuda.math_sdp_enabled() else "disabled"))
    return backends


def stderr_of(call: Callable[[], Any]) -> tuple[Any, str]:
    """`call()`, and what it wrote to the process's stderr meanwhile, read back instead of shown. PyTorch's SDPA
    eligibility checks warn through c10's C++ handler, which some builds (2.11+cu130, seen on an H100) print
    straight to file descriptor 2 as `[W...] Warning: ... (function ...)` lines, not as Python warnings."""
    import tempfile

    sys.stderr.flush()
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            result = call()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        sink.seek(0)
        return result, sink.read().decode("utf-8", errors="replace")


def cpp_warnings(text: str) -> list[str]:
    """The messages of c10's warning lines: `[W1125 ...] Warning: <message> (function <name>)`."""
    import re

    return [m.group(1) for m in re.finditer(r"Warning: (.*?)(?: \(function [^)]*\))?$", text, re.M)]
